"""PyTorch's bundled FlashAttention-2 (aten._flash_attention_forward/backward) and the one rule
every FlashAttention-2 build shares (the flash-attn package's too, dtcp/kernels/fa2.py)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .. import _compat
from ..plan import Band, Task
from .base import Kernel, VarlenSeqs, cuda_half_reason


def fa2_window_reason(q_len: int, k_len: int, band, name: str) -> Optional[str]:
    """Why FlashAttention-2's bottom-right window cannot give `band` on a q_len x k_len block, or
    None. FA2's flash_api.cpp turns window_size_right >= seqlen_k into "unbounded", which is only
    right while the bound cannot bind; with q longer than k and bottom-right alignment it can
    (row 0 still stops at key hi). Seen on H200 with torch's flash and flash-attn 2.8.3."""
    left, right = band.aligned_window(q_len, k_len)
    if (band.lo is not None and left < 0) or (band.hi is not None and right < 0):
        return f"{name} cannot express band ({band.lo}, {band.hi}) on a {q_len}x{k_len} block"
    if band.hi is not None and right >= k_len and band.hi < k_len - 1:
        return (f"{name} drops a right window >= the key length, and band ({band.lo}, {band.hi}) on a "
                f"{q_len}x{k_len} block needs it")
    if band.lo is not None and left >= 0 and right < 0 and q_len > k_len + 1:
        # A left window with no right bound becomes right = seqlen_k inside FA2, which binds when q
        # is longer than k (row 0 then stops before the last key; measured on H100: a 300x20
        # sequence under window (0, -1) gave a non-finite lse).
        return (f"{name} turns an unbounded right window into seqlen_k, which cuts band ({band.lo}, None) on a "
                f"{q_len}x{k_len} block")
    return None


def flash_band_reason(tasks: Iterable[Task], name: str) -> Optional[str]:
    """Why FlashAttention-2's window cannot express some task's band, or None."""
    for t in tasks:
        why = fa2_window_reason(t.q_len, t.k_len, t.band, name)
        if why is not None:
            return why
    return None


def flash2_reason(q: torch.Tensor, tasks: Iterable[Task], name: str) -> Optional[str]:
    """Why a FlashAttention-2 kernel (PyTorch's bundled one or the flash-attn package's) cannot
    serve these inputs and tasks, or None."""
    return cuda_half_reason(q, name, 256) or flash_band_reason(tasks, name)


def fa2_varlen_reason(seq_lens, window, name: str) -> Optional[str]:
    """fa2_window_reason for every sequence of a varlen call with one bottom-right window."""
    for q_len, k_len in seq_lens:
        why = fa2_window_reason(q_len, k_len, Band.from_aligned_window(q_len, k_len, window), name)
        if why is not None:
            return why
    return None


def _flash_args(window: tuple[int, int]) -> dict:
    left, right = window
    causal = left < 0 and right == 0
    return dict(causal=causal, window_size_left=None if causal else left, window_size_right=None if causal else right)


class CudaFlashKernel(Kernel):
    """fp16/bf16, head dim <= 256, GQA and sliding windows native (bottom-right aligned)."""

    name = "flash"
    supports_varlen = True
    varlen_one_launch = True  # aten._flash_attention_forward with cum_seq_q/k

    def reject_reason(self, q, k, tasks):
        return flash2_reason(q, tasks, "flash")

    def reject_varlen_reason(self, seq_lens, window):
        return fa2_varlen_reason(seq_lens, window, "flash")

    def varlen_forward(self, q, k, v, seqs: VarlenSeqs, window, scale, softcap=None, sink=None):
        fwd, _ = _compat.cuda_flash_ops()
        a = _flash_args(window)
        out, lse, *_ = fwd(q, k, v, seqs.cu_q_t, seqs.cu_k_t, seqs.max_q, seqs.max_k, 0.0, a["causal"], False,
                           scale=scale, window_size_left=a["window_size_left"],
                           window_size_right=a["window_size_right"])
        return out, _compat.flash_varlen_lse(lse, q)

    def varlen_backward(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale, softcap=None):
        _, bwd = _compat.cuda_flash_ops()
        a = _flash_args(window)
        no_rng = torch.empty(2, dtype=torch.int64, device=q.device)  # unused without dropout
        return bwd(dout, q, k, v, out, lse.float().contiguous(), seqs.cu_q_t, seqs.cu_k_t, seqs.max_q, seqs.max_k,
                   0.0, a["causal"], no_rng, no_rng, scale=scale, window_size_left=a["window_size_left"],
                   window_size_right=a["window_size_right"])

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        fwd, _ = _compat.cuda_flash_ops()
        lq, lk = q.shape[2], k.shape[2]
        a = _flash_args(Band(lo, hi).aligned_window(lq, lk))
        out, lse, *_ = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, lq, lk, 0.0,
                           a["causal"], False, scale=scale, window_size_left=a["window_size_left"],
                           window_size_right=a["window_size_right"])
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        _, bwd = _compat.cuda_flash_ops()
        lq, lk = q.shape[2], k.shape[2]
        a = _flash_args(Band(lo, hi).aligned_window(lq, lk))
        no_rng = torch.empty(2, dtype=torch.int64, device=q.device)  # unused without dropout
        dq, dk, dv = bwd(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.float().contiguous(), None, None, lq, lk, 0.0, a["causal"], no_rng, no_rng, scale=scale,
            window_size_left=a["window_size_left"], window_size_right=a["window_size_right"],
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
