"""The all-gather schedule (`kv_exchange="allgather"`): forward and backward on plain tensors.

Forward: every rank's K/V are gathered in one collective, put in global token order, and each
task of the `AllGatherPlan` is one kernel call of a run of this rank's queries against every key
it sees. Each query row is computed by exactly one call, so out and lse come straight from the
kernel: no merge.

Backward: each task's kernel backward gives that run's dQ whole and its share of dK/dV over the
global keys, summed in float32; one reduce-scatter returns to each rank the sum over ranks for
its own K/V. The gathered K/V come from the forward when the caller kept them (the eager path
does: N times this rank's K/V per attention call, which `auto` bounds at 16 MiB) and are gathered
again otherwise (the custom op, whose outputs are only out and lse).

Buffers, with L local tokens, S = N * L and rank-major order = rank 0's tokens, then rank 1's:
    sent:      (2, B, Hkv, L, D)         this rank's K and V
    gathered:  (N, 2, B, Hkv, L, D)      every rank's, rank-major
    global:    (2, B, Hkv, S, D)         K and V in token order (one index_select; none for the
                                         contiguous layout, whose rank-major order is token order)
Every reordering is one indexed copy with an index built once per plan and device.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _compat
from .comm import STATS
from .kernels import Kernel, acc_dtype
from .schedule import AllGatherPlan


def _rows(t0: int, t1: int):
    return (slice(None), slice(None), slice(t0, t1))


_INDEX: dict = {}


def _orders(plan: AllGatherPlan, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(to_global, to_rank_major): int64 indices along the sequence with
    global[g] = rank_major[to_global[g]] and rank_major[i] = global[to_rank_major[i]];
    (None, None) when the two orders are the same (contiguous layout)."""
    key = (plan.global_order, plan.piece_len, device)
    cached = _INDEX.get(key)
    if cached is None:
        p_len = plan.piece_len
        if plan.global_order == tuple(range(len(plan.global_order))):
            cached = (None, None)
        else:
            tokens = torch.arange(p_len)
            to_global = torch.cat([p * p_len + tokens for p in plan.global_order])
            to_rank_major = torch.cat([j * p_len + tokens for j in plan.rank_major_positions])
            cached = (to_global.to(device), to_rank_major.to(device))
        if len(_INDEX) >= 256:
            _INDEX.clear()
        _INDEX[key] = cached
    return cached


def all_gather_kv(send: torch.Tensor, pg, world_size: int) -> torch.Tensor:
    """(N * 2, ...): every rank's `send` (2, ...) = its stacked K and V, rank-major, counted in
    dtcp.comm_stats as one K/V round."""
    # flat along dim 0: gloo takes no stacked shape
    gathered = send.new_empty((world_size * send.shape[0],) + send.shape[1:])
    _compat.all_gather_into(gathered, send, pg)
    STATS.kv_rounds += 1
    STATS.kv_bytes_sent += (world_size - 1) * send.numel() * send.element_size()
    return gathered


def reduce_scatter_dkv(send: torch.Tensor, pg, world_size: int) -> torch.Tensor:
    """(2, ...): the sum over ranks of this rank's part of `send` (N * 2, ...) = every rank's
    stacked dK and dV shares, rank-major, counted in dtcp.comm_stats as one gradient round."""
    mine = send.new_empty((send.shape[0] // world_size,) + send.shape[1:])
    _compat.reduce_scatter_into(mine, send, pg)
    STATS.grad_rounds += 1
    STATS.grad_bytes_sent += (world_size - 1) * mine.numel() * mine.element_size()
    return mine


def gather_kv(k, v, pg, plan: AllGatherPlan) -> torch.Tensor:
    """(2, B, Hkv, S, D): every rank's K and V in global token order."""
    b, h, l_len, d = k.shape
    n = plan.world_size
    gathered = all_gather_kv(torch.stack((k, v)), pg, n).view(n, 2, b, h, l_len, d)
    # (N, 2, B, Hkv, L, D) -> (2, B, Hkv, N*L, D), rank-major along the sequence
    kv = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, n * l_len, d)
    to_global, _ = _orders(plan, k.device)
    return kv if to_global is None else kv.index_select(3, to_global)


def allgather_forward(q, k, v, pg, plan: AllGatherPlan, kernel: Kernel, scale: float, keep_kv: bool = False):
    """q: (B, Hq, L, D), k/v: (B, Hkv, L, D), this rank's shards. Returns out (B, Hq, L, D) in
    q.dtype, lse (B, Hq, L) float32 (float64 for float64) and, with keep_kv, the gathered K/V
    (2, B, Hkv, S, D) for allgather_backward (else None)."""
    acc = acc_dtype(q.dtype)
    kv = gather_kv(k, v, pg, plan)
    outs, lses = [], []
    for task in plan.tasks:
        ks = _rows(task.k_start, task.k_end)
        o, l = kernel.forward(q[_rows(task.q_start, task.q_end)], kv[0][ks], kv[1][ks], task.lo, task.hi, scale)
        outs.append(o)
        lses.append(l)
    kept = kv if keep_kv else None
    if plan.rows_tiled:
        # Contiguous, as the op's fake promises (cat makes a fresh tensor; a lone task's output
        # may be a transposed view).
        if len(outs) == 1:
            return outs[0].to(q.dtype).contiguous(), lses[0].to(acc).contiguous(), kept
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).to(acc), kept
    # Rows in no task see no key (padding under a document mask): out 0 and lse 0, as the ring.
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:-1], dtype=acc, device=q.device)
    for task, o, l in zip(plan.tasks, outs, lses):
        qs = _rows(task.q_start, task.q_end)
        out[qs] = o
        lse[qs] = l
    return out, lse, kept


def allgather_backward(dout, q, k, v, out, lse, pg, plan: AllGatherPlan, kernel: Kernel, scale: float,
                       kv: Optional[torch.Tensor] = None):
    """Gradients of allgather_forward (kv: its kept K/V, or None to gather them again).
    Returns dq, dk, dv in the input dtypes."""
    acc = acc_dtype(q.dtype)
    b, h, l_len, d = k.shape
    n = plan.world_size
    if kv is None:
        kv = gather_kv(k, v, pg, plan)
    dkv = torch.zeros((2, b, h, plan.seq_len, d), dtype=acc, device=k.device)
    dqs = []
    for task in plan.tasks:
        qs, ks = _rows(task.q_start, task.q_end), _rows(task.k_start, task.k_end)
        dq_t, dk_t, dv_t = kernel.backward(dout[qs], q[qs], kv[0][ks], kv[1][ks], out[qs], lse[qs],
                                           task.lo, task.hi, scale)
        dqs.append(dq_t)
        dkv[0][ks] += dk_t
        dkv[1][ks] += dv_t
        del dk_t, dv_t
    del kv
    if plan.rows_tiled:
        dq = (dqs[0].contiguous() if len(dqs) == 1 else torch.cat(dqs, dim=2)).to(q.dtype)
    else:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        for task, dq_t in zip(plan.tasks, dqs):
            dq[_rows(task.q_start, task.q_end)] = dq_t
    # Global order -> rank-major, rank first for the reduce-scatter: (N, 2, B, Hkv, L, D).
    _, to_rank_major = _orders(plan, k.device)
    if to_rank_major is not None:
        dkv = dkv.index_select(3, to_rank_major)
    send = dkv.view(2, b, h, n, l_len, d).permute(3, 0, 1, 2, 4, 5).reshape(n * 2, b, h, l_len, d)
    del dkv
    mine = reduce_scatter_dkv(send, pg, n)
    # copy=True: fresh dk and dv even when no cast is needed (outputs must not alias each other)
    return dq, mine[0].to(k.dtype, copy=True), mine[1].to(v.dtype, copy=True)
