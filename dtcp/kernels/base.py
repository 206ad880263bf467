"""The interface every local attention kernel implements.

Every kernel computes one schedule `Task` on local tensors (SDPA layout, B H L D):

    forward(q, k, v, lo, hi, scale, softcap=None, sink=None)   -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq)
    backward(dout, q, k, v, out, lse, lo, hi, scale, softcap=None)
                                                 -> dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv)

`lo`/`hi` give the band mask (key j visible from query i iff lo <= j - i <= hi, None = unbounded).
`lse` is the natural-log sum of exponentials, float32 (float64 for float64 inputs). In the
backward, `out` and `lse` are the *merged* (global) values for these query rows, which makes the
kernel's gradient exactly this block's share of the full gradient. K/V may have fewer heads than
Q (GQA); dk/dv come back with the K/V head count.

Optional features, each declared by a class attribute (`feature_reason` refuses what a kernel
lacks): `softcap` (Gemma 2's tanh capping of the scaled scores, softcap * tanh(s / softcap), before
the mask), `sink` in the forward ((Hq,) float32 logits, one extra column in every row's softmax with
no value: gpt-oss's attention sinks; the returned lse includes it, and the backward needs nothing
more, since it takes the final lse), and a value head dim Dv different from D (MLA).

Kernels with `supports_varlen` also take many sequences in one call, packed as in flash-attn's
varlen functions (sequence i: rows cu_q[i]:cu_q[i+1] of q, cu_k[i]:cu_k[i+1] of k/v), with one
bottom-right aligned window (left, right) for all of them ((-1, 0) = causal, -1 = unbounded):

    varlen_forward(q, k, v, seqs, window, scale)                   -> out (Tq, Hq, D), lse (Hq, Tq)
    varlen_backward(dout, q, k, v, out, lse, seqs, window, scale)  -> dq (Tq, Hq, D), dk, dv (Tk, Hkv, D)

The base class loops over the sequences with `forward`/`backward` (the reference the one-launch
kernels are tested against).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional

import torch

from ..plan import Band, Task


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class Target:
    """The device a kernel is chosen for, where it is not the tensors' own: a GPU *assumed*, not
    present. `dtcp.explain` on meta tensors predicts what a call on CUDA would run, so it asks the
    kernels with `Target("cuda", capability)`: device type "cuda", that compute capability, and
    every optional kernel package (FlashAttention-4, flash-attn) counted as installed; nothing is
    imported and no device is queried. Kernel methods take `target=None` for the tensors' device."""

    device_type: str
    capability: tuple[int, int] = (9, 0)


def int32_rows(rows, device) -> list[torch.Tensor]:
    """Lists of ints as int32 tensors on `device`, in one host-to-device copy: views of one
    buffer, each starting 16 bytes apart from the next (its rows padded to a multiple of four).
    Why aligned: FlashAttention-4's backward copies every cu_seqlens / seqused tensor whose address
    is not a multiple of 16 bytes (flash_attn/cute/cute_dsl_utils.py maybe_contiguous), an
    allocation and a copy kernel per launch; the second row of a plain (2, n + 1) tensor is
    aligned only where n + 1 is a multiple of four."""
    width = max(len(r) for r in rows) + 3 & ~3
    packed = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, r in enumerate(rows):
        packed[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    packed = packed.to(device)
    return [packed[i, :len(r)] for i, r in enumerate(rows)]


def device_type(q, target: Optional[Target]) -> str:
    """The device type a kernel decides for: the target's, else q's."""
    return q.device.type if target is None else target.device_type


@dataclass(frozen=True)
class VarlenSeqs:
    """The sequences of one varlen call: cumulative lengths on the host (cu_q, cu_k) and as int32
    tensors on the device (cu_q_t, cu_k_t), and the longest query and key lengths.

    `used_q` / `used_k` (kernels with `varlen_gaps` only): sequence i takes rows
    [cu_q[i], cu_q[i] + used_q[i]) (keys likewise), leaving the rows up to cu_q[i + 1] out (FA4's
    seqused_q / seqused_k): a launch then reads rows and keys that lie apart in place, as views,
    instead of gathering them. What the kernel returns for left-out rows and keys is undefined."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    cu_q_t: torch.Tensor
    cu_k_t: torch.Tensor
    max_q: int
    max_k: int
    used_q: Optional[tuple[int, ...]] = None
    used_k: Optional[tuple[int, ...]] = None
    used_q_t: Optional[torch.Tensor] = None
    used_k_t: Optional[torch.Tensor] = None

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """(row start, row end, key start, key end) of each sequence."""
        n = len(self.cu_q) - 1
        used_q = self.used_q or [b - a for a, b in zip(self.cu_q, self.cu_q[1:])]
        used_k = self.used_k or [b - a for a, b in zip(self.cu_k, self.cu_k[1:])]
        return [(self.cu_q[i], self.cu_q[i] + used_q[i], self.cu_k[i], self.cu_k[i] + used_k[i]) for i in range(n)]


class Kernel:
    name = "kernel"
    supports_varlen = False  # takes varlen_forward/varlen_backward
    varlen_one_launch = False  # ... in one kernel launch (else a loop over the sequences)
    varlen_gaps = False  # ... whose sequences may leave rows and keys out between them (VarlenSeqs.used_q)
    takes_softcap = False
    takes_sinks = False  # forward(sink=...)
    takes_value_head_dim = False  # v's head dim may differ from q's and k's

    def reject_reason(self, q: torch.Tensor, k: torch.Tensor, tasks: Iterable[Task],
                      target: Optional[Target] = None) -> Optional[str]:
        """None when this kernel can serve every task on these inputs, else why not. `target`: an
        assumed device to decide for instead of q's (Target); only q's shape and dtype are read then."""
        raise NotImplementedError

    def feature_reason(self, q: torch.Tensor, v: Optional[torch.Tensor], softcap: Optional[float],
                       sinks: bool, target: Optional[Target] = None) -> Optional[str]:
        """Why this kernel cannot take the optional features asked for, or None."""
        if softcap is not None and not self.takes_softcap:
            return f"{self.name} has no softcap"
        if sinks and not self.takes_sinks:
            return f"{self.name} takes no attention sinks"
        if v is not None and v.shape[-1] != q.shape[-1] and not self.takes_value_head_dim:
            return f"{self.name} needs v's head dim to equal q's and k's ({v.shape[-1]} != {q.shape[-1]})"
        return None

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this kernel's backward returns dQ in for inputs of `dtype` (what the ring
        keeps a launch's dQ in until the pass sums them: exec/fused.py Slots)."""
        return dtype

    def reject_varlen_reason(self, seq_lens: Iterable[tuple[int, int]], window: tuple[int, int]) -> Optional[str]:
        """None when one varlen call with these (q_len, k_len) sequences and this bottom-right
        window is exactly what the kernel computes, else why not (kernel quirks)."""
        return None if self.supports_varlen else f"{self.name} takes no varlen calls"

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        raise NotImplementedError

    # Into given tensors: the ring keeps a pass's later blocks whole, in slots, to merge (sum) them
    # once at its end (exec/fused.py Slots). Kernels that take output tensors override these; here
    # the results are copied in (the same values).
    def forward_into(self, q, k, v, lo, hi, scale, out, lse, softcap=None):
        """forward, its results written into out (B, Hq, Lq, Dv) and lse (B, Hq, Lq) (float32;
        float64 for float64): strided views, last dim contiguous. Returns (out, lse)."""
        o, l = self.forward(q, k, v, lo, hi, scale, softcap=softcap)
        out.copy_(o)
        lse.copy_(l)
        return out, lse

    def backward_into(self, dout, q, k, v, out, lse, lo, hi, scale, dq, softcap=None):
        """backward, its dq written into `dq` (a strided view of q's shape in grad_dtype, last dim
        contiguous). Returns (dq, dk, dv)."""
        dq_t, dk, dv = self.backward(dout, q, k, v, out, lse, lo, hi, scale, softcap=softcap)
        return dq.copy_(dq_t), dk, dv

    # The varlen interface as a loop of per-sequence calls: (T, H, D) rows <-> (1, H, T, D) blocks.
    def varlen_forward(self, q, k, v, seqs: VarlenSeqs, window, scale, softcap=None, sink=None):
        gaps = seqs.used_q is not None
        outs, lses, out = [], [], None
        for qa, qb, ka, kb in seqs.bounds():
            band = Band.from_aligned_window(qb - qa, kb - ka, window)
            o, l = self.forward(rows_to_block(q[qa:qb]), rows_to_block(k[ka:kb]), rows_to_block(v[ka:kb]),
                                band.lo, band.hi, scale, softcap=softcap, sink=sink)
            if gaps:
                if out is None:  # rows left out: NaN, as undefined as a one-launch kernel leaves them
                    out = o.new_full((q.shape[0],) + o.shape[1:2] + o.shape[3:], float("nan"))
                    lse_all = torch.full((l.shape[1], q.shape[0]), float("nan"), dtype=l.dtype, device=l.device)
                out[qa:qb], lse_all[:, qa:qb] = block_to_rows(o), l[0]
                continue
            outs.append(block_to_rows(o))
            lses.append(l[0])
        if gaps:
            return out, lse_all
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale, softcap=None):
        gaps = seqs.used_q is not None or seqs.used_k is not None
        if gaps:  # rows and keys left out: NaN, as undefined as a one-launch kernel leaves them
            dq_all, dk_all, dv_all = (torch.full_like(x, float("nan")) for x in (q, k, v))
        dqs, dks, dvs = [], [], []
        for qa, qb, ka, kb in seqs.bounds():
            band = Band.from_aligned_window(qb - qa, kb - ka, window)
            dq, dk, dv = self.backward(
                rows_to_block(dout[qa:qb]), rows_to_block(q[qa:qb]), rows_to_block(k[ka:kb]),
                rows_to_block(v[ka:kb]), rows_to_block(out[qa:qb]), lse[None, :, qa:qb], band.lo, band.hi, scale,
                softcap=softcap)
            if gaps:  # (keys of distinct sequences are distinct: VarlenSeqs' contract with gaps)
                dq_all[qa:qb], dk_all[ka:kb], dv_all[ka:kb] = block_to_rows(dq), block_to_rows(dk), block_to_rows(dv)
                continue
            dqs.append(block_to_rows(dq))
            dks.append(block_to_rows(dk))
            dvs.append(block_to_rows(dv))
        if gaps:
            return dq_all, dk_all, dv_all
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)

    # Into given tensors: the ring's first launch of a pass writes its results straight into the
    # call's outputs (dtcp/exec/ring.py). Kernels that take output tensors override these; here the
    # results are copied in (the same values).
    def varlen_forward_into(self, q, k, v, seqs: VarlenSeqs, window, scale, out, lse, softcap=None, sink=None):
        """varlen_forward, its results written into out (Tq, Hq, Dv) and lse (Hq, Tq) (float32;
        float64 for float64), which may be strided views (last dim contiguous). Returns (out, lse)."""
        o, l = self.varlen_forward(q, k, v, seqs, window, scale, softcap=softcap, sink=sink)
        out.copy_(o)
        lse.copy_(l)
        return out, lse

    def varlen_backward_into(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale, softcap=None,
                             dq=None, dk=None, dv=None):
        """varlen_backward, each gradient written into dq / dk / dv where given (strided views of
        q's, k's and v's shapes and dtypes, last dim contiguous), else returned fresh."""
        grads = self.varlen_backward(dout, q, k, v, out, lse, seqs, window, scale, softcap=softcap)
        return tuple(g if into is None else into.copy_(g) for g, into in zip(grads, (dq, dk, dv)))


def landed(got, into) -> tuple:
    """A kernel's results where the caller asked for them (`into`: a tensor per result, or None):
    one that returned others (an FA4 that ignored its output tensors) has them copied in, so a
    result is never left unwritten."""
    return tuple(g if dest is None or _same_view(g, dest) else dest.copy_(g) for g, dest in zip(got, into))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are a and b the same elements (b itself, or a view of the same memory, shape and strides:
    what a kernel that wrote into a transposed view of b returns, transposed back)?"""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def seq_slice(start: int, end: int) -> tuple:
    """Index of sequence positions [start, end) of a (B, H, L, D) or (B, H, L) tensor."""
    return (slice(None), slice(None), slice(start, end))


def rows_to_block(rows: torch.Tensor) -> torch.Tensor:
    return rows.transpose(0, 1).unsqueeze(0)  # (T, H, D) -> (1, H, T, D)


def block_to_rows(block: torch.Tensor) -> torch.Tensor:
    return block[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)


def full_or_square_causal_reason(tasks: Iterable[Task], name: str) -> Optional[str]:
    for t in tasks:
        if not (t.is_full or t.is_square_causal):
            return (f"{name} only takes full or square causal blocks, and the schedule has band ({t.lo}, {t.hi}) "
                    f"on a {t.q_len}x{t.k_len} block")
    return None


@dataclass(frozen=True)
class KeyedBlock:
    """The part of a band-masked q_len x k_len block that has work: query rows r0:r1 (exactly the
    rows that see at least one key) and keys c0:c1 (exactly the keys some row sees), with `band`
    the same mask in the sub-block's own indices (bounds that cannot bind dropped). Row 0 of the
    sub-block sees its key 0 and its last row its last key, so the sub-block's bottom-right window
    has no negative bound. `empty` when no row sees any key."""

    r0: int
    r1: int
    c0: int
    c1: int
    band: Band

    @property
    def empty(self) -> bool:
        return self.r1 <= self.r0

    def whole(self, q_len: int, k_len: int) -> bool:
        """No row and no key left out."""
        return (self.r0, self.r1, self.c0, self.c1) == (0, q_len, 0, k_len)


def keyed_block(q_len: int, k_len: int, lo: Optional[int], hi: Optional[int]) -> KeyedBlock:
    """The rows and keys of band (lo, hi) (key j visible from query i iff lo <= j - i <= hi, None =
    unbounded) on a q_len x k_len block that have work: see KeyedBlock. Kernels whose own mask
    misreads rows without keys (FlashAttention-2's lse, FlashAttention-4's block ranges) run only
    this sub-block and give the rows left out out 0, lse -inf."""
    if q_len <= 0 or k_len <= 0 or (lo is not None and hi is not None and lo > hi):
        return KeyedBlock(0, 0, 0, 0, Band(None, None))
    # Row i sees keys [max(0, i + lo), min(k_len - 1, i + hi)]: some iff i + hi >= 0 and i + lo < k_len.
    r0 = 0 if hi is None else max(0, -hi)
    r1 = q_len if lo is None else min(q_len, k_len - lo)
    if r0 >= r1:
        return KeyedBlock(0, 0, 0, 0, Band(None, None))
    c0 = 0 if lo is None else max(0, r0 + lo)
    c1 = k_len if hi is None else min(k_len, r1 + hi)
    sub = Band(None if lo is None else lo + r0 - c0, None if hi is None else hi + r0 - c0)
    return KeyedBlock(r0, r1, c0, c1, sub.normalized(r1 - r0, c1 - c0))


def keyless_sequence(seq_lens: Iterable[tuple[int, int]], window: tuple[int, int]) -> Optional[tuple[int, int]]:
    """The first (q_len, k_len) sequence of a varlen call under this bottom-right window whose
    first rows see no key (more queries than keys under a right bound), or None. (The window's
    left side never leaves the last rows without one: bottom-right, the last row sees the last
    key.) A varlen launch cannot be cut into sub-blocks, so kernels that misread such rows refuse it."""
    right = window[1]
    for q_len, k_len in seq_lens:
        if q_len > 0 and (k_len == 0 or (right >= 0 and k_len - q_len + right < 0)):
            return (q_len, k_len)
    return None


def no_key_rows(shape, dtype, device, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """lse (B, H, n) of rows that see no key: -inf, or the sink's logit per head (out stays 0)."""
    if sink is None:
        return torch.full(shape, float("-inf"), dtype=dtype, device=device)
    return sink.to(device=device, dtype=dtype)[None, :, None].expand(shape).clone()


def cuda_half_reason(q: torch.Tensor, name: str, max_head_dim: int, target: Optional[Target] = None) -> Optional[str]:
    """Why a CUDA fp16/bf16 kernel taking head dims that are multiples of 8 up to max_head_dim
    cannot take q (on `target`, else on q's device), or None."""
    if device_type(q, target) != "cuda":
        return f"{name} needs CUDA tensors; got {device_type(q, target)}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{name} takes float16/bfloat16; got {q.dtype}"
    if q.shape[-1] > max_head_dim or q.shape[-1] % 8:
        return f"{name} needs head_dim <= {max_head_dim} and a multiple of 8; got {q.shape[-1]}"
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


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # SDPA's enable_gqa convention: query head h uses key/value head h // groups.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, l_len, d = x.shape
    return x.view(b, h // groups, groups, l_len, d).sum(2)
