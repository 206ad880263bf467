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


def cudnn_ops():
    # aten._scaled_dot_product_cudnn_attention / _backward: logsumexp comes back (B, H, L, 1);
    #   causal is top-left aligned. Checked on torch 2.11+cu130, cuDNN 9.19 (H200).
    return (
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
    )


# ---- the SDPA builtin ---------------------------------------------------------------------------
# F.scaled_dot_product_attention is the builtin torch._C._nn.scaled_dot_product_attention, and a
# name imported from torch.nn.functional is that same object. Checked on torch 2.11 and 2.13.
# dtcp.context_parallel matches both in its TorchFunctionMode in case a release wraps one.
def sdpa_functions() -> frozenset:
    import torch.nn.functional as F

    return frozenset({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})
