"""Local attention kernels behind one interface (kernels/base.py), one module per kernel, and the
choice among them. A new kernel subclasses `Kernel`, lives in its own module here and is added to
`KERNELS` (and to `AUTO_ORDER` where `backend="auto"` should consider it)."""

from __future__ import annotations

import logging

import torch

from ..plan import Task
from .base import Kernel, Target, VarlenSeqs, acc_dtype, band_mask, band_mask_traceable, default_scale
from .cpu_flash import CpuFlashKernel
from .cudnn import CudnnKernel
from .fa2 import FlashAttnPackageKernel
from .fa4 import Fa4Kernel
from .flash import CudaFlashKernel, flash_band_reason
from .flex import FlexKernel
from .math import MathKernel

log = logging.getLogger("dtcp")

__all__ = ["Kernel", "Target", "VarlenSeqs", "KERNELS", "AUTO_ORDER", "select_kernel", "acc_dtype", "default_scale",
           "band_mask", "band_mask_traceable", "flash_band_reason"]

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (MathKernel(), CpuFlashKernel(), CudaFlashKernel(), CudnnKernel(), FlashAttnPackageKernel(), Fa4Kernel(),
              FlexKernel())
}

# Fastest first, by the measurements in docs/performance.md (Backends on H200); the flash-attn
# package's FA2 is the same algorithm as PyTorch's bundled flash. FlashAttention-4 (flash-attn-4)
# leads where it is installed and applicable (its reject_reason refuses otherwise: not installed,
# compute capability < 9.0, ...), and auto falls through to cuDNN.
AUTO_ORDER = {"cpu": ("cpu_flash", "math"), "cuda": ("fa4", "cudnn", "flash", "fa2", "flex", "math")}


def select_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, tasks: list[Task],
                  varlen: tuple = None, *, v: torch.Tensor = None, softcap: float = None,
                  sinks: bool = False, target: Target = None) -> Kernel:
    """The kernel named by `backend`, or for "auto" the fastest that serves every task.

    `varlen` = (seq_lens, window) asks for a kernel that takes the tasks as one varlen call (see
    Kernel.reject_varlen_reason); "auto" then prefers kernels that do it in one launch (many small
    tasks are one launch there and one launch each elsewhere). `v`, `softcap` and `sinks` (the
    kernel must add the sinks itself) ask for the optional features (Kernel.feature_reason).
    `target`: decide for an assumed device instead of q's (kernels/base.py Target: dtcp.explain
    on meta tensors asks what CUDA would run); only the tensors' shapes and dtypes are read then.
    Raises ValueError with every kernel's reason when none can serve."""
    def reason(kernel: Kernel):
        why = kernel.feature_reason(q, v, softcap, sinks, target) or kernel.reject_reason(q, k, tasks, target)
        if why is None and varlen is not None:
            why = kernel.reject_varlen_reason(*varlen)
        return why

    if backend == "auto":
        reasons = []
        order = AUTO_ORDER.get(q.device.type if target is None else target.device_type, ("math",))
        if varlen is not None:
            order = sorted(order, key=lambda name: not KERNELS[name].varlen_one_launch)
        for name in order:
            why = reason(KERNELS[name])
            if why is None:
                log.debug("dtcp: backend='auto' picked %r on %s %s", name, target or q.device.type, q.dtype)
                return KERNELS[name]
            reasons.append(why)
        raise ValueError("backend='auto' found no kernel for this request: " + "; ".join(reasons))
    if backend not in KERNELS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(KERNELS)}; got {backend!r}")
    why = reason(KERNELS[backend])
    if why is not None:
        raise ValueError(f"backend={backend!r} cannot serve this request: {why}")
    return KERNELS[backend]
