"""The math kernel: pure torch, any device and dtype, any band, softcap, sinks and a value head dim
of its own. The reference."""

from __future__ import annotations

import torch

from .base import Kernel, acc_dtype, band_mask, repeat_kv, sum_groups


class MathKernel(Kernel):
    """Pure torch, any device and dtype, any band: the reference. Computes in float32/float64."""

    name = "math"
    supports_varlen = True  # the base class's loop
    takes_softcap = True
    takes_sinks = True
    takes_value_head_dim = True

    def reject_reason(self, q, k, tasks, target=None):
        if not q.is_floating_point():
            return f"math needs floating-point inputs; got {q.dtype}"
        return None

    def _scores(self, q, k, lo, hi, scale, softcap, mask_fn=band_mask):
        """(masked logits, tanh of the capped scores or None, GQA group size)."""
        acc = acc_dtype(q.dtype)
        g = q.shape[1] // k.shape[1]
        s = torch.matmul(q.to(acc), repeat_kv(k, g).to(acc).transpose(-1, -2)) * scale
        capped = None
        if softcap is not None:
            capped = torch.tanh(s / softcap)
            s = softcap * capped
        mask = mask_fn(q.shape[2], k.shape[2], lo, hi, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s, capped, g

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None, mask_fn=band_mask):
        """mask_fn: band_mask, or band_mask_traceable where torch.compile traces the call
        (differentiable then through autograd: lse is returned attached)."""
        s, _, g = self._scores(q, k, lo, hi, scale, softcap, mask_fn)
        lse = torch.logsumexp(s, dim=-1)
        if sink is not None:  # one more column per row, logit sink[h], no value
            lse = torch.logaddexp(lse, sink.to(lse.dtype)[None, :, None])
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.matmul(p, repeat_kv(v, g).to(s.dtype))
        return out.to(q.dtype), lse

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return acc_dtype(dtype)  # (its gradients come back in the dtype it computes in)

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        s, capped, g = self._scores(q, k, lo, hi, scale, softcap)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        dout = dout.to(acc)
        vv = repeat_kv(v, g).to(acc)
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, vv.transpose(-1, -2))
        delta = (dout * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if capped is not None:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
            ds = ds * (1 - capped * capped)
        dq = torch.matmul(ds, repeat_kv(k, g).to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq, sum_groups(dk, g), sum_groups(dv, g)
