"""The flash-attn package's FlashAttention-2 (flash_attn.flash_attn_interface), when installed
(`pip install -e ".[fa2]"`): BSHD, bottom-right aligned windows like PyTorch's bundled flash."""

from __future__ import annotations

import torch

from .. import _compat
from ..plan import Band
from .base import Kernel
from .flash import flash2_reason


class FlashAttnPackageKernel(Kernel):
    name = "fa2"
    takes_softcap = True

    def reject_reason(self, q, k, tasks, target=None):
        if target is None and _compat.flash_attn_package_ops() is None:  # (an assumed GPU has it)
            return 'fa2 needs the flash-attn package (pip install -e ".[fa2]"); it is not installed'
        return flash2_reason(q, tasks, "fa2", target)

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        fwd, _ = _compat.flash_attn_package_ops()
        left, right = Band(lo, hi).aligned_window(q.shape[2], k.shape[2])
        out, lse, *_ = fwd(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, False, left, right, softcap or 0.0,
            None, False,
        )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        _, bwd = _compat.flash_attn_package_ops()
        left, right = Band(lo, hi).aligned_window(q.shape[2], k.shape[2])
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qt, kt, vt))
        bwd(
            dout.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse.float().contiguous(), dq, dk, dv,
            0.0, scale, False, left, right, softcap or 0.0, None, False, None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
