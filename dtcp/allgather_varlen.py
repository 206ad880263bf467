"""The all-gather schedule for a whole batch as one varlen kernel call (`VarlenPlan`).

Used where documents would otherwise make dozens of small kernel calls per batch row (see
schedule.VarlenPlan): every (row, task) pair becomes one sequence of a single packed call.

Forward: one all-gather of every rank's K/V, one indexed copy that lays out each sequence's keys
back to back (keys two sequences share, e.g. a document both of a rank's zigzag runs reach, are
copied twice), one kernel call. Backward: one kernel call, one indexed accumulate of the
sequences' dK/dV into float32 buffers (summing the copies), one reduce-scatter.

Buffers, with L local tokens, N ranks, T_k packed keys:
    sent:      (2, B, L, Hkv, D)        this rank's K and V, token-major (the packed layout's)
    gathered:  (N, 2, B*L, Hkv, D)      every rank's
    packed:    (2, T_k, Hkv, D)         each sequence's keys and values, back to back
Queries are packed by viewing q (B, Hq, L, D) as (B*L, Hq, D): a copy-free view when q is laid
out token-major (as in models that transpose (B, L, H, D) projections). Every query row belongs
to exactly one sequence (VarlenPlan.rows_tiled, required where the plan is made), so the packed
rows are the local rows in order and out/lse need no scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .allgather import all_gather_kv, reduce_scatter_dkv
from .kernels import Kernel, VarlenSeqs, acc_dtype
from .schedule import VarlenPlan


@dataclass(frozen=True)
class _Packing:
    seqs: VarlenSeqs
    key_rank: torch.Tensor  # (T_k,) rank holding each packed key
    key_row: torch.Tensor  # (T_k,) its index into that rank's B*L token rows


_PACKINGS: dict = {}


def _packing(plan: VarlenPlan, device: torch.device) -> _Packing:
    """Index tensors for `plan`, built once per plan object and device (plans are cached, so
    every layer of a model step reuses them)."""
    key = (id(plan), device)
    hit = _PACKINGS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    l_len = plan.local_len
    first = plan.rows[0]
    r_count, p_len = first.runs_per_rank, first.piece_len
    # global position g -> (owning rank, local index there)
    owner, local = [], []
    for piece in first.global_order:
        owner.append(torch.full((p_len,), piece // r_count, dtype=torch.int64))
        local.append((piece % r_count) * p_len + torch.arange(p_len))
    owner, local = torch.cat(owner), torch.cat(local)
    cu_q, cu_k, key_rank, key_row = [0], [0], [], []
    for b, row_plan in enumerate(plan.rows):
        for t in row_plan.tasks:
            cu_q.append(cu_q[-1] + t.q_len)
            cu_k.append(cu_k[-1] + t.k_len)
            key_rank.append(owner[t.k_start:t.k_end])
            key_row.append(b * l_len + local[t.k_start:t.k_end])
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    cu = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(device)
    seqs = VarlenSeqs(tuple(cu_q), tuple(cu_k), cu[0], cu[1], max_q, max_k)
    packing = _Packing(seqs, torch.cat(key_rank).to(device), torch.cat(key_row).to(device))
    if len(_PACKINGS) >= 64:
        _PACKINGS.clear()
    _PACKINGS[key] = (plan, packing)
    return packing


def _pack_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*L, H, D): the query rows of the sequences, in order."""
    b, h, l_len, d = x.shape
    return x.transpose(1, 2).reshape(b * l_len, h, d)


def _contiguous(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous copy of `view` in `dtype`: what the ops' fake implementations promise.
    (Tensor.to(dtype, memory_format=...) returns the view itself when the dtype already matches.)"""
    return torch.empty(view.shape, dtype=dtype, device=view.device).copy_(view)


def _unpack_rows(packed: torch.Tensor, shape, dtype) -> torch.Tensor:
    """(B*L, H, D) -> (B, H, L, D) contiguous, in `dtype`."""
    b, h, l_len, d = shape
    return _contiguous(packed.view(b, l_len, h, d).transpose(1, 2), dtype)


def _pack_lse(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, L) -> (H, B*L), contiguous as the kernels take it."""
    b, h, l_len = lse.shape
    return lse.permute(1, 0, 2).reshape(h, b * l_len).contiguous()


def _unpack_lse(packed: torch.Tensor, shape, dtype) -> torch.Tensor:
    """(H, B*L) -> (B, H, L) contiguous, in `dtype`."""
    b, h, l_len = shape
    return _contiguous(packed.view(h, b, l_len).transpose(0, 1), dtype)


def gather_packed_kv(k, v, pg, plan: VarlenPlan, packing: _Packing) -> torch.Tensor:
    """(2, T_k, Hkv, D): the keys and values of every sequence, back to back."""
    b, h, l_len, d = k.shape
    n = plan.world_size
    gathered = all_gather_kv(torch.stack((k.transpose(1, 2), v.transpose(1, 2))), pg, n)  # (N*2, B, L, Hkv, D)
    # (N, 2, B*L, Hkv, D) -> (2, N, B*L, Hkv, D) view; one gather picks every packed key
    return gathered.view(n, 2, b * l_len, h, d).transpose(0, 1)[:, packing.key_rank, packing.key_row]


def allgather_varlen_forward(q, k, v, pg, plan: VarlenPlan, kernel: Kernel, scale: float, keep_kv: bool = False):
    """q: (B, Hq, L, D), k/v: (B, Hkv, L, D), this rank's shards. Returns out (B, Hq, L, D) in
    q.dtype, lse (B, Hq, L) float32 (float64 for float64) and, with keep_kv, the packed K/V for
    allgather_varlen_backward (else None)."""
    packing = _packing(plan, q.device)
    kv = gather_packed_kv(k, v, pg, plan, packing)
    out, lse = kernel.varlen_forward(_pack_rows(q), kv[0], kv[1], packing.seqs, plan.window, scale)
    out, lse = _unpack_rows(out, q.shape, q.dtype), _unpack_lse(lse, q.shape[:-1], acc_dtype(q.dtype))
    return out, lse, (kv if keep_kv else None)


def allgather_varlen_backward(dout, q, k, v, out, lse, pg, plan: VarlenPlan, kernel: Kernel, scale: float,
                              kv: Optional[torch.Tensor] = None):
    """Gradients of allgather_varlen_forward (kv: its kept packed K/V, or None to gather again).
    Returns dq, dk, dv in the input dtypes."""
    acc = acc_dtype(q.dtype)
    b, h, l_len, d = k.shape
    n = plan.world_size
    packing = _packing(plan, q.device)
    if kv is None:
        kv = gather_packed_kv(k, v, pg, plan, packing)
    dq, dk, dv = kernel.varlen_backward(
        _pack_rows(dout), _pack_rows(q), kv[0], kv[1], _pack_rows(out), _pack_lse(lse), packing.seqs, plan.window,
        scale,
    )
    del kv
    # Sum the sequences' shares per key (a key two sequences share appears twice) in float32,
    # straight into the rank-major layout the reduce-scatter sends.
    dkv = torch.zeros((n, 2, b * l_len, h, d), dtype=acc, device=k.device)
    torch.ops.aten.index_put_(dkv.transpose(0, 1), [None, packing.key_rank, packing.key_row],
                              torch.stack((dk, dv)).to(acc), True)
    del dk, dv
    mine = reduce_scatter_dkv(dkv.view(n * 2, b, l_len, h, d), pg, n)
    return (_unpack_rows(dq, q.shape, q.dtype), _contiguous(mine[0].transpose(1, 2), k.dtype),
            _contiguous(mine[1].transpose(1, 2), v.dtype))
