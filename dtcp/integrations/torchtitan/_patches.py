"""The torchtitan internals dtcp's integration touches, each with the release it was checked on.

Checked on torchtitan 0.2.2 with torch 2.11+cu130 (GPU image) and 2.13.0+cpu. When a torchtitan
release moves one of these, this is the module to change.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from importlib.metadata import version

TORCHTITAN_VERSION = "0.2.2"  # what the 0.2.2 helpers below were checked on


def make_torchtitan_importable() -> None:
    """Let `import torchtitan` work on machines without triton (CPU-only torch wheels).

    torchtitan 0.2.2's package __init__ imports its MoE code, whose `models/moe/kernels.py`
    does `import triton` at import time, although only MoE token permutation on GPUs uses it.
    CPU-only torch wheels do not bring triton (CUDA wheels do), and triton's own wheel is
    ~290 MB. Where triton is missing, register a stand-in for that one torchtitan module whose
    functions raise; triton itself is not faked, so torch still sees that triton is absent.
    Has no effect where triton is installed or torchtitan is already imported.
    """
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def _needs_triton(*args, **kwargs):
        raise RuntimeError(
            "torchtitan's MoE permutation kernel needs triton, which is not installed here "
            "(dtcp.integrations.torchtitan replaced torchtitan.models.moe.kernels with a stand-in "
            "so that torchtitan imports without triton). Install triton to train MoE models."
        )

    stand_in = types.ModuleType(name, "stand-in for torchtitan's triton MoE kernels (triton missing)")
    stand_in.generate_permute_indices = _needs_triton
    stand_in.fill_indices_wrapper = _needs_triton
    stand_in.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    sys.modules[name] = stand_in


def torchtitan_version() -> str:
    return version("torchtitan")


# The releases dtcp's integration was written against: 0.2.2 (_v022) and 0.3.0 (_v030).
SUPPORTED = ("0.2.2", "0.3.0")


def torchtitan_release() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan; ImportError naming the fix when it is none of
    the supported releases (0.2.x, 0.3.x)."""
    try:
        found = torchtitan_version()
    except Exception:
        raise ImportError("dtcp.integrations.torchtitan needs torchtitan: pip install \"dtcp[torchtitan03]\" "
                          "(torchtitan 0.3.0, torch >= 2.14) or \"dtcp[torchtitan]\" (torchtitan 0.2.2)") from None
    parts = found.split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        release = None
    if release not in ((0, 2), (0, 3)):
        raise ImportError(f"dtcp.integrations.torchtitan supports torchtitan {' and '.join(SUPPORTED)}; found "
                          f"{found}. Install one of them: pip install torchtitan==0.3.0 (torch >= 2.14) or "
                          "torchtitan==0.2.2")
    return release


class replaced_global:
    """Context manager: within it, the global `name` that function `fn` sees is `value`.

    torchtitan 0.2.2's per-model parallelize functions (e.g. parallelize_llama) call the name
    `apply_cp_to_attention_module`, imported into their own module, to hand attention modules to
    PyTorch's context parallelism. dtcp swaps that one name for the duration of the call.

    Also used on torchtitan 0.3.0, whose parallelize_llama / parallelize_qwen3 call
    `apply_cp_to_forward` (imported into their modules) when spmd_backend is "partial_dtensor".
    """

    def __init__(self, fn, name: str, value, checked_on: str = TORCHTITAN_VERSION):
        self.globals, self.name, self.value = fn.__globals__, name, value
        if name not in self.globals:
            raise RuntimeError(
                f"{fn.__module__}.{fn.__qualname__} does not use {name!r}: dtcp's torchtitan "
                f"integration was written against torchtitan {checked_on}; found "
                f"{torchtitan_version()}."
            )

    def __enter__(self):
        self.saved = self.globals[self.name]
        self.globals[self.name] = self.value
        return self

    def __exit__(self, *exc):
        self.globals[self.name] = self.saved
        return False


def patch_torchtitan_cp_shard(replacement) -> None:
    """Route torchtitan's CP input sharding through `replacement` (same signature).

    torchtitan 0.2.2's Trainer.post_dataloading_process calls
    `prepare_context_parallel_input`, which calls the module-level `cp_shard(cp_mesh, inputs,
    attention_masks, load_balancer_type, input_seq_dim=1)` of
    torchtitan.distributed.context_parallel to shard (inputs, labels, positions) and the
    attention masks. `replacement` receives the original as `replacement.torchtitan_cp_shard`
    for the meshes it does not own. Idempotent."""
    # imported here, not at the top: this module must load before torchtitan does
    # (make_torchtitan_importable runs first)
    import torchtitan.distributed.context_parallel as tt_cp

    current = tt_cp.cp_shard
    if current is replacement:
        return
    if getattr(current, "__module__", "") != tt_cp.__name__:
        raise RuntimeError(
            f"torchtitan.distributed.context_parallel.cp_shard is already replaced by "
            f"{current.__module__}.{current.__qualname__}; dtcp will not stack a second patch"
        )
    replacement.torchtitan_cp_shard = current
    tt_cp.cp_shard = replacement
