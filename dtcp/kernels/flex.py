"""flex_attention as a kernel: any band mask (blocks made from the band directly, never a dense
mask), GQA, fp16/bf16/fp32, CUDA.

Its backward recomputes the block under autograd and reweights it to the merged (global) out and
lse, because flex_attention's public API has no backward that takes an external lse:
  with w = exp(lse_block - lse_global) per row, the block's share of the global gradient is flex's
  own gradient for dout' = w * dout and d(lse_block) = rowsum(dout' * out_block) - w * rowsum(dout *
  out_global)  (the second term replaces flex's softmax correction by the global one).
That costs one extra block forward in the backward; flex is the general-mask fallback, not the
fast path.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .. import _compat
from .base import Kernel, acc_dtype, device_type

_FLEX_BLOCK = 128


@lru_cache(maxsize=1)
def _compiled_flex():
    # The ring calls flex from inside a custom op's implementation: compiled here, at run time,
    # once per shape (the outer torch.compile never traces into the op).
    return torch.compile(flex_attention, dynamic=False)


@lru_cache(maxsize=64)
def _softcap_score_mod(softcap: float):
    """tanh capping of the scaled scores, one function object per value (so flex's compiled
    kernels are reused across calls)."""
    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped


def _band_mask_mod(lo: Optional[int], hi: Optional[int]):
    def band(b, h, q_idx, kv_idx):
        d = kv_idx - q_idx
        keep = d == d  # all True, as a tensor
        if lo is not None:
            keep = keep & (d >= lo)
        if hi is not None:
            keep = keep & (d <= hi)
        return keep

    return band


@lru_cache(maxsize=256)
def band_block_mask(lq: int, lk: int, lo: Optional[int], hi: Optional[int], device: str):
    """flex BlockMask of the band lo <= kv - q <= hi on an lq x lk block, built from block-level
    arithmetic (O(blocks), no lq x lk mask is ever materialised). None = no mask."""
    if lo is None and hi is None:
        return None
    b = _FLEX_BLOCK
    nq, nk = math.ceil(lq / b), math.ceil(lk / b)
    q_first = torch.arange(nq) * b
    q_last = torch.clamp(q_first + b, max=lq) - 1
    k_first = torch.arange(nk) * b
    k_last = torch.clamp(k_first + b, max=lk) - 1
    d_min = k_first[None, :] - q_last[:, None]  # smallest kv - q inside each block pair
    d_max = k_last[None, :] - q_first[:, None]
    some = torch.ones(nq, nk, dtype=torch.bool)
    every = torch.ones(nq, nk, dtype=torch.bool)
    if lo is not None:
        some &= d_max >= lo
        every &= d_min >= lo
    if hi is not None:
        some &= d_min <= hi
        every &= d_max <= hi
    partial = some & ~every

    def blocks(m):  # (nq, nk) bool -> counts (1, 1, nq), indices (1, 1, nq, nk) listed ones first
        count = m.sum(-1).to(torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None].to(device), order[None, None].to(device)

    return BlockMask.from_kv_blocks(
        *blocks(partial), *blocks(every), BLOCK_SIZE=b, mask_mod=_band_mask_mod(lo, hi), seq_lengths=(lq, lk)
    )


class FlexKernel(Kernel):
    """torch.nn.attention.flex_attention, compiled: any band, CUDA (no flex backward on CPU)."""

    name = "flex"
    takes_softcap = True

    def reject_reason(self, q, k, tasks, target=None):
        if device_type(q, target) != "cuda":
            return f"flex needs CUDA tensors (flex_attention has no backward on CPU); got {device_type(q, target)}"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"flex takes float16/bfloat16/float32; got {q.dtype}"
        if q.shape[-1] < 16:
            return f"flex needs head_dim >= 16; got {q.shape[-1]}"
        return None

    def _run(self, q, k, v, lo, hi, scale, softcap=None):
        mask = band_block_mask(q.shape[2], k.shape[2], lo, hi, str(q.device))
        score_mod = None if softcap is None else _softcap_score_mod(float(softcap))
        return _compat.flex_attention_with_lse(_compiled_flex(), q, k, v, mask, scale, q.shape[1] != k.shape[1],
                                               score_mod=score_mod)

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        return self._run(q, k, v, lo, hi, scale, softcap)

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        acc = acc_dtype(q.dtype)
        with _compat.autograd_inside_custom_op():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out_blk, lse_blk = self._run(qg, kg, vg, lo, hi, scale, softcap)
            lse_glob = lse.to(acc)
            lse_own = lse_blk.detach().to(acc)
            # Rows this block does not reach (lse_blk = -inf) or no block reaches (padding) get 0.
            w = torch.where(torch.isneginf(lse_own) | torch.isneginf(lse_glob),
                            torch.zeros_like(lse_glob), torch.exp(lse_own - lse_glob))
            dout_w = (dout.to(acc) * w.unsqueeze(-1)).to(out_blk.dtype)
            d_lse = (dout_w.to(acc) * out_blk.detach().to(acc)).sum(-1) - w * (dout.to(acc) * out.to(acc)).sum(-1)
            dq, dk, dv = torch.autograd.grad((out_blk, lse_blk), (qg, kg, vg), (dout_w, d_lse.to(lse_blk.dtype)))
        return dq, dk, dv
