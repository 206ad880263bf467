"""cuDNN SDPA (aten._scaled_dot_product_cudnn_attention and its backward): the fastest of PyTorch's
own kernels on Hopper for full and square-causal blocks."""

from __future__ import annotations

import torch

from .. import _compat
from .base import Kernel, cuda_half_reason, full_or_square_causal_reason


class CudnnKernel(Kernel):
    """fp16/bf16, head dim <= 128, top-left causal, GQA native."""

    name = "cudnn"

    def reject_reason(self, q, k, tasks, target=None):
        why = cuda_half_reason(q, "cudnn", 128, target)
        if why is not None:
            return why
        tasks = list(tasks)
        if any(t.q_len == 1 and t.k_len == 1 for t in tasks):
            # cuDNN 9.19 frontend: "s_q = s_kv = 1 is not supported" (a single-token document).
            return "cudnn cannot take a 1x1 block (a single-token document)"
        return full_or_square_causal_reason(tasks, "cudnn")

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        fwd, _ = _compat.cudnn_ops()
        out, lse, *_ = fwd(q, k, v, None, True, 0.0, hi is not None, False, scale=scale)
        return out, lse.view(lse.shape[0], lse.shape[1], lse.shape[2])

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        _, bwd = _compat.cudnn_ops()
        lq, lk = q.shape[2], k.shape[2]
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # unused without dropout
        # cuDNN wants grad_out laid out like out. Slices of (B, H, L, D) tensors already agree;
        # copy only when they don't.
        if out.stride() != dout.stride():
            out, dout = out.contiguous(), dout.contiguous()
        return bwd(
            dout, q, k, v, out, lse.float().contiguous().unsqueeze(-1), no_rng, no_rng, None, None, None,
            lq, lk, 0.0, hi is not None, scale=scale,
        )
