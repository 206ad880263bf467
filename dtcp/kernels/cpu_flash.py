"""PyTorch's CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu and its backward)."""

from __future__ import annotations

import torch

from .. import _compat
from .base import Kernel, acc_dtype, device_type, full_or_square_causal_reason


class CpuFlashKernel(Kernel):
    """Top-left causal or full blocks, CPU, fp32/fp64/bf16/fp16, GQA native."""

    name = "cpu_flash"
    supports_varlen = True  # the base class's loop
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def reject_reason(self, q, k, tasks, target=None):
        if device_type(q, target) != "cpu":
            return f"cpu_flash runs on CPU tensors; got {device_type(q, target)}"
        if q.dtype not in self.dtypes:
            return f"cpu_flash takes {self.dtypes}; got {q.dtype}"
        return full_or_square_causal_reason(tasks, "cpu_flash")

    def reject_varlen_reason(self, seq_lens, window):
        left, right = window
        if not (left < 0 and right in (-1, 0)):
            return f"cpu_flash takes full or causal sequences, not window {window}"
        if right == 0 and any(q != k for q, k in seq_lens):
            return "cpu_flash aligns causal top-left: it takes only square causal sequences"
        return None

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        out, lse = _compat.cpu_flash_forward(q, k, v, 0.0, hi is not None, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        return _compat.cpu_flash_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse, 0.0, hi is not None, scale=scale
        )
