"""Local attention kernels behind one small interface.

Every kernel computes one schedule `Task` on local tensors (SDPA layout, B H L D):

    forward(q, k, v, lo, hi, scale)                   -> out (B, Hq, Lq, D), lse (B, Hq, Lq)
    backward(dout, q, k, v, out, lse, lo, hi, scale)  -> dq (B, Hq, Lq, D), dk, dv (B, Hkv, Lk, D)

`lo`/`hi` give the band mask (key j visible from query i iff lo <= j - i <= hi, None = unbounded).
`lse` is the natural-log sum of exponentials, float32 (float64 for float64 inputs). In the
backward, `out` and `lse` are the *merged* (global) values for these query rows, which makes the
kernel's gradient exactly this block's share of the full gradient. K/V may have fewer heads than
Q (GQA); dk/dv come back with the K/V head count.

Kernels with `supports_varlen` also take many sequences in one call, packed as in flash-attn's
varlen functions (sequence i: rows cu_q[i]:cu_q[i+1] of q, cu_k[i]:cu_k[i+1] of k/v), with one
bottom-right aligned window (left, right) for all of them ((-1, 0) = causal, -1 = unbounded):

    varlen_forward(q, k, v, seqs, window, scale)                   -> out (Tq, Hq, D), lse (Hq, Tq)
    varlen_backward(dout, q, k, v, out, lse, seqs, window, scale)  -> dq (Tq, Hq, D), dk, dv (Tk, Hkv, D)

PyTorch's flash kernel does this in one launch; the base class loops over the sequences with
`forward`/`backward` (the reference the one-launch kernels are tested against).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional

import torch

from . import _compat
from .schedule import Task

log = logging.getLogger("dtcp")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class VarlenSeqs:
    """The sequences of one varlen call: cumulative lengths on the host (cu_q, cu_k) and as int32
    tensors on the device (cu_q_t, cu_k_t), and the longest query and key lengths."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    cu_q_t: torch.Tensor
    cu_k_t: torch.Tensor
    max_q: int
    max_k: int


def window_band(q_len: int, k_len: int, window: tuple[int, int]) -> tuple[Optional[int], Optional[int]]:
    """Bottom-right aligned window (left, right) -> band (lo, hi) on a q_len x k_len block."""
    left, right = window
    shift = k_len - q_len
    return (None if left < 0 else shift - left, None if right < 0 else shift + right)


class Kernel:
    name = "kernel"
    supports_varlen = False  # takes varlen_forward/varlen_backward
    varlen_one_launch = False  # ... in one kernel launch (else a loop over the sequences)

    def reject_reason(self, q: torch.Tensor, k: torch.Tensor, tasks: Iterable[Task]) -> Optional[str]:
        """None when this kernel can serve every task on these inputs, else why not."""
        raise NotImplementedError

    def forward(self, q, k, v, lo, hi, scale):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale):
        raise NotImplementedError

    # The varlen interface as a loop of per-sequence calls: (T, H, D) rows <-> (1, H, T, D) blocks.
    def varlen_forward(self, q, k, v, seqs: VarlenSeqs, window, scale):
        outs, lses = [], []
        for qa, qb, ka, kb in zip(seqs.cu_q, seqs.cu_q[1:], seqs.cu_k, seqs.cu_k[1:]):
            lo, hi = window_band(qb - qa, kb - ka, window)
            o, l = self.forward(_block(q[qa:qb]), _block(k[ka:kb]), _block(v[ka:kb]), lo, hi, scale)
            outs.append(_rows(o))
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale):
        dqs, dks, dvs = [], [], []
        for qa, qb, ka, kb in zip(seqs.cu_q, seqs.cu_q[1:], seqs.cu_k, seqs.cu_k[1:]):
            lo, hi = window_band(qb - qa, kb - ka, window)
            qs = [_block(t[qa:qb]) for t in (dout, q)]
            dq, dk, dv = self.backward(qs[0], qs[1], _block(k[ka:kb]), _block(v[ka:kb]), _block(out[qa:qb]),
                                       lse[None, :, qa:qb], lo, hi, scale)
            dqs.append(_rows(dq))
            dks.append(_rows(dk))
            dvs.append(_rows(dv))
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


def _block(rows: torch.Tensor) -> torch.Tensor:
    return rows.transpose(0, 1).unsqueeze(0)  # (T, H, D) -> (1, H, T, D)


def _rows(block: torch.Tensor) -> torch.Tensor:
    return block[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)


def _reject_unless_top_left_causal_or_full(tasks: Iterable[Task], name: str) -> Optional[str]:
    for t in tasks:
        if not (t.is_full or t.is_square_causal):
            return f"{name} only takes full or square causal blocks, and the schedule has band ({t.lo}, {t.hi}) on a {t.q_len}x{t.k_len} block"
    return None


@lru_cache(maxsize=64)
def _band_mask_cpu(lq: int, lk: int, lo: Optional[int], hi: Optional[int]) -> torch.Tensor:
    d = torch.arange(lk)[None, :] - torch.arange(lq)[:, None]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if lo is not None:
        keep &= d >= lo
    if hi is not None:
        keep &= d <= hi
    return keep


def band_mask(lq, lk, lo, hi, device) -> Optional[torch.Tensor]:
    """Boolean (lq, lk) mask, True = visible; None for full attention."""
    if lo is None and hi is None:
        return None
    return _band_mask_cpu(lq, lk, lo, hi).to(device)


def band_mask_traceable(lq, lk, lo, hi, device) -> Optional[torch.Tensor]:
    """band_mask built from tensor ops on `device` each call, for code traced by torch.compile
    (a cached tensor would enter the graph as a constant from outside the fake tensor mode)."""
    if lo is None and hi is None:
        return None
    offset = torch.arange(lk, device=device)[None, :] - torch.arange(lq, device=device)[:, None]
    keep = torch.ones_like(offset, dtype=torch.bool)
    if lo is not None:
        keep = keep & (offset >= lo)
    if hi is not None:
        keep = keep & (offset <= hi)
    return keep


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # SDPA's enable_gqa convention: query head h uses key/value head h // groups.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, l, d = x.shape
    return x.view(b, h // groups, groups, l, d).sum(2)


class MathKernel(Kernel):
    """Pure torch, any device and dtype, any band: the reference. Computes in float32/float64."""

    name = "math"
    supports_varlen = True  # the base class's loop

    def reject_reason(self, q, k, tasks):
        if not q.is_floating_point():
            return f"math needs floating-point inputs; got {q.dtype}"
        return None

    def _scores(self, q, k, lo, hi, scale, mask_fn=band_mask):
        acc = acc_dtype(q.dtype)
        g = q.shape[1] // k.shape[1]
        s = torch.matmul(q.to(acc), _repeat_kv(k, g).to(acc).transpose(-1, -2)) * scale
        mask = mask_fn(q.shape[2], k.shape[2], lo, hi, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s, g

    def forward(self, q, k, v, lo, hi, scale, mask_fn=band_mask):
        """mask_fn: band_mask, or band_mask_traceable where torch.compile traces the call
        (differentiable then through autograd: lse is returned attached)."""
        s, g = self._scores(q, k, lo, hi, scale, mask_fn)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.matmul(p, _repeat_kv(v, g).to(s.dtype))
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale):
        s, g = self._scores(q, k, lo, hi, scale)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        dout = dout.to(acc)
        vv = _repeat_kv(v, g).to(acc)
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, vv.transpose(-1, -2))
        delta = (dout * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, _repeat_kv(k, g).to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq, _sum_groups(dk, g), _sum_groups(dv, g)


class CpuFlashKernel(Kernel):
    """aten._scaled_dot_product_flash_attention_for_cpu and its backward (top-left causal)."""

    name = "cpu_flash"
    supports_varlen = True  # the base class's loop
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def reject_reason(self, q, k, tasks):
        if q.device.type != "cpu":
            return f"cpu_flash runs on CPU tensors; got {q.device.type}"
        if q.dtype not in self.dtypes:
            return f"cpu_flash takes {self.dtypes}; got {q.dtype}"
        return _reject_unless_top_left_causal_or_full(tasks, "cpu_flash")

    def forward(self, q, k, v, lo, hi, scale):
        out, lse = _compat.cpu_flash_forward(q, k, v, 0.0, hi is not None, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale):
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        return _compat.cpu_flash_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse, 0.0, hi is not None, scale=scale
        )


def _flash_window(t_q: int, t_k: int, lo, hi) -> tuple[int, int]:
    """Band (lo, hi) -> flash's bottom-right aligned (window_left, window_right); -1 = unbounded."""
    shift = t_k - t_q
    left = -1 if lo is None else shift - lo
    right = -1 if hi is None else hi - shift
    return left, right


def flash_band_reason(tasks: Iterable[Task], name: str) -> Optional[str]:
    """Why FlashAttention-2's window cannot express some task's band, or None."""
    for t in tasks:
        left, right = _flash_window(t.q_len, t.k_len, t.lo, t.hi)
        if (t.lo is not None and left < 0) or (t.hi is not None and right < 0):
            return f"{name} cannot express band ({t.lo}, {t.hi}) on a {t.q_len}x{t.k_len} block"
        # FA2's flash_api.cpp turns window_size_right >= seqlen_k into "unbounded", which is only
        # right while the bound cannot bind; with q longer than k and bottom-right alignment it
        # can (row 0 still stops at key hi). Seen on H200 with torch's flash and flash-attn 2.8.3.
        if t.hi is not None and right >= t.k_len and t.hi < t.k_len - 1:
            return (f"{name} drops a right window >= the key length, and band ({t.lo}, {t.hi}) on a "
                    f"{t.q_len}x{t.k_len} block needs it")
    return None


def cuda_half_reason(q: torch.Tensor, name: str, max_head_dim: int) -> Optional[str]:
    """Why a CUDA fp16/bf16 kernel taking head dims that are multiples of 8 up to max_head_dim
    cannot take q, or None."""
    if q.device.type != "cuda":
        return f"{name} needs CUDA tensors; got {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{name} takes float16/bfloat16; got {q.dtype}"
    if q.shape[-1] > max_head_dim or q.shape[-1] % 8:
        return f"{name} needs head_dim <= {max_head_dim} and a multiple of 8; got {q.shape[-1]}"
    return None


def flash2_reason(q: torch.Tensor, tasks: Iterable[Task], name: str) -> Optional[str]:
    """Why a FlashAttention-2 kernel (PyTorch's bundled one or the flash-attn package's) cannot
    serve these inputs and tasks, or None."""
    return cuda_half_reason(q, name, 256) or flash_band_reason(tasks, name)


class CudaFlashKernel(Kernel):
    """PyTorch's bundled FlashAttention-2 (aten._flash_attention_forward/backward): fp16/bf16,
    head dim <= 256, GQA and sliding windows native (bottom-right aligned)."""

    name = "flash"
    supports_varlen = True
    varlen_one_launch = True  # aten._flash_attention_forward with cum_seq_q/k

    def reject_reason(self, q, k, tasks):
        return flash2_reason(q, tasks, "flash")

    def varlen_forward(self, q, k, v, seqs: VarlenSeqs, window, scale):
        fwd, _ = _compat.cuda_flash_ops()
        left, right = window
        causal = left < 0 and right == 0
        out, lse, *_ = fwd(
            q, k, v, seqs.cu_q_t, seqs.cu_k_t, seqs.max_q, seqs.max_k, 0.0, causal, False, scale=scale,
            window_size_left=None if causal else left, window_size_right=None if causal else right,
        )
        return out, _compat.flash_varlen_lse(lse, q)

    def varlen_backward(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale):
        _, bwd = _compat.cuda_flash_ops()
        left, right = window
        causal = left < 0 and right == 0
        no_rng = torch.empty(2, dtype=torch.int64, device=q.device)  # unused without dropout
        return bwd(
            dout, q, k, v, out, lse.float().contiguous(), seqs.cu_q_t, seqs.cu_k_t, seqs.max_q, seqs.max_k, 0.0,
            causal, no_rng, no_rng, scale=scale, window_size_left=None if causal else left,
            window_size_right=None if causal else right,
        )

    def forward(self, q, k, v, lo, hi, scale):
        fwd, _ = _compat.cuda_flash_ops()
        lq, lk = q.shape[2], k.shape[2]
        left, right = _flash_window(lq, lk, lo, hi)
        causal = lo is None and right == 0
        out, lse, *_ = fwd(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, lq, lk, 0.0, causal, False,
            scale=scale, window_size_left=None if causal else left, window_size_right=None if causal else right,
        )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale):
        _, bwd = _compat.cuda_flash_ops()
        lq, lk = q.shape[2], k.shape[2]
        left, right = _flash_window(lq, lk, lo, hi)
        causal = lo is None and right == 0
        no_rng = torch.empty(2, dtype=torch.int64, device=q.device)  # unused without dropout
        dq, dk, dv = bwd(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.float().contiguous(), None, None, lq, lk, 0.0, causal, no_rng, no_rng,
            scale=scale, window_size_left=None if causal else left, window_size_right=None if causal else right,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class CudnnKernel(Kernel):
    """cuDNN SDPA (aten._scaled_dot_product_cudnn_attention/backward): fp16/bf16, top-left causal.
    The fastest kernel on Hopper for full and square-causal blocks."""

    name = "cudnn"

    def reject_reason(self, q, k, tasks):
        why = cuda_half_reason(q, "cudnn", 128)
        if why is not None:
            return why
        tasks = list(tasks)
        if any(t.q_len == 1 and t.k_len == 1 for t in tasks):
            # cuDNN 9.19 frontend: "s_q = s_kv = 1 is not supported" (a single-token document).
            return "cudnn cannot take a 1x1 block (a single-token document)"
        return _reject_unless_top_left_causal_or_full(tasks, "cudnn")

    def forward(self, q, k, v, lo, hi, scale):
        fwd, _ = _compat.cudnn_ops()
        out, lse, *_ = fwd(q, k, v, None, True, 0.0, hi is not None, False, scale=scale)
        return out, lse.view(lse.shape[0], lse.shape[1], lse.shape[2])

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale):
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


from .kernels_optional import FlashAttnPackageKernel, FlexKernel  # noqa: E402  (they subclass Kernel)

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (MathKernel(), CpuFlashKernel(), CudaFlashKernel(), CudnnKernel(), FlashAttnPackageKernel(), FlexKernel())
}

# Fastest first (H200 measurements in shared FACTS: cuDNN ~2x PyTorch flash on Hopper; flex
# below both; the flash-attn package's FA2 is the same algorithm as PyTorch's bundled flash).
AUTO_ORDER = {"cpu": ("cpu_flash", "math"), "cuda": ("cudnn", "flash", "fa2", "flex", "math")}


def select_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, tasks: list[Task],
                  prefer_varlen: bool = False) -> Kernel:
    """The kernel named by `backend`, or for "auto" the fastest that serves every task (with
    prefer_varlen, kernels that run a varlen call in one launch first: many small tasks are one
    launch there and one launch each elsewhere)."""
    if backend == "auto":
        reasons = []
        order = AUTO_ORDER.get(q.device.type, ("math",))
        if prefer_varlen:
            order = sorted(order, key=lambda name: not KERNELS[name].varlen_one_launch)
        for name in order:
            why = KERNELS[name].reject_reason(q, k, tasks)
            if why is None:
                log.debug("dtcp: backend='auto' picked %r on %s %s", name, q.device.type, q.dtype)
                return KERNELS[name]
            reasons.append(why)
        raise ValueError("backend='auto' found no kernel for this request: " + "; ".join(reasons))
    if backend not in KERNELS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(KERNELS)}; got {backend!r}")
    why = KERNELS[backend].reject_reason(q, k, tasks)
    if why is not None:
        raise ValueError(f"backend={backend!r} cannot serve this request: {why}")
    return KERNELS[backend]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
