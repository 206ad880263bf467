"""Every private or version-dependent torch API dtcp touches lives here.

Each entry names the torch versions it was checked on. When a new torch release breaks one,
this is the only module to change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def group_from_name(name: str) -> "dist.ProcessGroup":
    # c10d._resolve_process_group: checked on torch 2.11 (CUDA) and 2.13 (CPU).
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def name_of_group(pg: "dist.ProcessGroup") -> str:
    # ProcessGroup.group_name: checked on torch 2.11 and 2.13.
    return pg.group_name


def new_high_priority_nccl_group(ranks: list[int]) -> "dist.ProcessGroup":
    # ProcessGroupNCCL.Options(is_high_priority_stream=...) and new_group(pg_options=...,
    # use_local_synchronization=...): checked on torch 2.11+cu130.
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return dist.new_group(ranks, backend="nccl", pg_options=opts, use_local_synchronization=True)


# Whole-tensor all-gather / reduce-scatter (output and input single tensors, dim 0 split).
# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single and deprecates the old names (FutureWarning); 2.11 has only the old ones.
# Checked on torch 2.11+cu130 (NCCL) and 2.13.0+cpu (gloo, both names).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, pg: "dist.ProcessGroup") -> None:
    """output (N * input.shape[0], ...) <- every rank's input, rank-major."""
    _ALL_GATHER(output, input, group=pg)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, pg: "dist.ProcessGroup") -> None:
    """output <- the sum over ranks of their input's rank-th slice along dim 0."""
    _REDUCE_SCATTER(output, input, group=pg)


def all_gather_autograd(x: torch.Tensor, pg: "dist.ProcessGroup") -> torch.Tensor:
    """Differentiable, traceable all-gather along dim 0 (backward: a reduce-scatter).
    torch.distributed._functional_collectives.all_gather_tensor_autograd(self, gather_dim, group):
    checked on torch 2.13.0+cpu (gloo, eager and compiled); present with this signature in 2.11."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_tensor_autograd(x, 0, pg)


def flash_attention_differentiable(q, k, v, is_causal: bool, scale: float):
    """(out, lse) of aten._scaled_dot_product_flash_attention (autograd registered in
    derivatives.yaml; lse not differentiable). Called directly it skips SDPA's dispatcher checks,
    and `is_causal` with fewer queries than keys is FlashAttention-2's bottom-right causal mask
    (the dispatcher refuses that case; the kernel does it). Output fields [0], [1] (output,
    logsumexp (B, H, L) float32): checked in the schema of torch 2.11+cu130 and 2.13."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return res[0], res[1]


def enable_symm_mem(group_name: str) -> None:
    # torch.distributed._symmetric_memory: enable_symm_mem_for_group must precede rendezvous on
    # torch 2.11 (checked on 2.11+cu130); later releases deprecate it as a no-op. The module
    # and rendezvous/get_buffer exist in 2.11 and 2.13.
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)


# ---- local attention kernels (aten ops, not public API) ----------------------------------
# aten._scaled_dot_product_flash_attention_for_cpu / _backward:
#   checked on torch 2.13 (CPU): returns (out, logsumexp (B, H, L)); causal is top-left aligned.
cpu_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def cuda_flash_ops():
    # aten._flash_attention_forward / _backward (BSHD layout, window_size_left/right kwargs):
    #   checked on torch 2.11+cu130 (H200) and present in the 2.13 schema.
    return torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default


def flash_varlen_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The logsumexp of aten._flash_attention_forward on packed (varlen) inputs: (Hq, total_q)
    float32 (FlashAttention-2 >= 2.6's unpadded layout; torch's meta function gives this shape
    on 2.13 and torch.nn.attention.varlen relies on it). Older builds padded it to
    (num_seqs, Hq, max_q); refuse that rather than misread it."""
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"dtcp: this torch's flash varlen kernel returned logsumexp of shape {tuple(lse.shape)}, not "
            f"(heads, total_q) = {(q.shape[1], q.shape[0])}; use kv_exchange='ring' or backend='math'"
        )
    return lse


def cudnn_ops():
    # aten._scaled_dot_product_cudnn_attention / _backward: logsumexp comes back (B, H, L, 1);
    #   causal is top-left aligned. Checked on torch 2.11+cu130, cuDNN 9.19 (H200).
    return (
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
    )


# ---- autograd inside a custom op's implementation ----------------------------------------
# A torch.library custom op's implementation runs with the Autograd dispatch keys excluded
# (thread-local), so nothing it computes records a graph. The flex backend's backward
# recomputes its block under autograd; this re-admits the Autograd and ADInplaceOrView keys for
# that block. torch._C._dispatch_tls_{is,set}_dispatch_key_excluded: checked on torch 2.11+cu130
# and 2.13.0+cpu.
class autograd_inside_custom_op:
    _KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)

    def __enter__(self):
        self.saved = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in self._KEYS]
        for k in self._KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        self.grad_mode = torch.enable_grad()
        self.grad_mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.grad_mode.__exit__(*exc)
        for k, was in zip(self._KEYS, self.saved):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)
        return False


# ---- eager fast path guard ----------------------------------------------------------------
def plain_eager_call(*tensors) -> bool:
    """True when a call can bypass the custom op: not tracing, exact torch.Tensor inputs (no
    DTensor/fake/functional subclasses), no TorchDispatchMode and no functorch transform active.
    torch.utils._python_dispatch.is_in_torch_dispatch_mode (user and infra modes) and
    torch._C._functorch.peek_interpreter_stack: checked on torch 2.11+cu130 and 2.13.0+cpu."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


# ---- flex_attention -----------------------------------------------------------------------
def flex_attention_with_lse(flex_fn, q, k, v, block_mask, scale, enable_gqa):
    """(out, lse) from flex_attention (or a torch.compile of it). torch.nn.attention.flex_attention
    takes return_aux=AuxRequest(lse=True) from 2.9 on (return_lse is deprecated there) and only
    return_lse before: checked on torch 2.11+cu130 and 2.13.0+cpu. lse is natural-log, float32."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = flex_fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                           return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return flex_fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)


# ---- the flash-attn package (FA2) ----------------------------------------------------------
def flash_attn_package_ops():
    """(forward, backward) of the flash-attn package, or None when it is not installed.
    flash_attn.flash_attn_interface._flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal,
    window_size_left, window_size_right, softcap, alibi_slopes, return_softmax) -> (out, lse,
    S_dmask, rng_state) and _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
    deterministic, rng_state) writing dq/dk/dv: checked on flash-attn 2.8.3 (BSHD layout, windows
    bottom-right aligned, GQA native)."""
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError:
        return None
    fwd, bwd = getattr(fai, "_flash_attn_forward", None), getattr(fai, "_flash_attn_backward", None)
    return None if fwd is None or bwd is None else (fwd, bwd)


# ---- the SDPA builtin ---------------------------------------------------------------------------
# F.scaled_dot_product_attention is the builtin torch._C._nn.scaled_dot_product_attention, and a
# name imported from torch.nn.functional is that same object. Checked on torch 2.11 and 2.13.
# dtcp.context_parallel matches both in its TorchFunctionMode in case a release wraps one.
def sdpa_functions() -> frozenset:
    import torch.nn.functional as F

    return frozenset({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})


# ---- torchtitan (dtcp.integrations.torchtitan) ---------------------------------------------
# Checked on torchtitan 0.2.2 with torch 2.11+cu130 (GPU image) and 2.13.0+cpu.

TORCHTITAN_VERSION = "0.2.2"


def make_torchtitan_importable() -> None:
    """Let `import torchtitan` work on machines without triton (CPU-only torch wheels).

    torchtitan 0.2.2's package __init__ imports its MoE code, whose `models/moe/kernels.py`
    does `import triton` at import time, although only MoE token permutation on GPUs uses it.
    CPU-only torch wheels do not bring triton (CUDA wheels do), and triton's own wheel is
    ~290 MB. Where triton is missing, register a stand-in for that one torchtitan module whose
    functions raise; triton itself is not faked, so torch still sees that triton is absent.
    Has no effect where triton is installed or torchtitan is already imported.
    """
    import importlib.util
    import sys
    import types

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
    from importlib.metadata import version

    return version("torchtitan")


class replaced_global:
    """Context manager: within it, the global `name` that function `fn` sees is `value`.

    torchtitan 0.2.2's per-model parallelize functions (e.g. parallelize_llama) call the name
    `apply_cp_to_attention_module`, imported into their own module, to hand attention modules to
    PyTorch's context parallelism. dtcp swaps that one name for the duration of the call."""

    def __init__(self, fn, name: str, value):
        self.globals, self.name, self.value = fn.__globals__, name, value
        if name not in self.globals:
            raise RuntimeError(
                f"{fn.__module__}.{fn.__qualname__} does not use {name!r}: dtcp's torchtitan "
                f"integration was written against torchtitan {TORCHTITAN_VERSION}; found "
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
