"""The all-gather schedule (`strategy="allgather"`): forward and backward on plain tensors.

Per task (`AllGatherPlan`): every rank's K/V are gathered in one collective, put in global token
order, and each task is one kernel call of a run of this rank's queries against every key it
sees. Each query row is computed by exactly one call, so out and lse come straight from the
kernel: no merge. The backward gives each task's dQ whole and its share of dK/dV over the global
keys, summed in float32; one reduce-scatter returns to each rank the sum for its own K/V.

As one varlen call (`VarlenPlan`, documents): one all-gather, one indexed copy that lays out each
sequence's keys back to back (keys two sequences share are copied twice), one kernel call, which
for one batch row (packed documents) writes out and lse into the results themselves; the backward
is one kernel call (dQ written in place likewise), one sum of the sequences' dK/dV into the
float32 buffer the reduce-scatter sends (summing the copies: exec/rowsum.py, one Triton kernel on
CUDA), one reduce-scatter.

The gathered K/V come from the forward when the caller kept them (the eager path: N times this
rank's K/V per attention call, which `auto` bounds at dtcp.config.allgather_max_bytes) and are
gathered again otherwise (the custom op, whose outputs are only out and lse).

Buffers, with L local tokens, S = N * L and rank-major order = rank 0's tokens, then rank 1's:
    sent:      (2, B, Hkv, L, D)         this rank's K and V (token-major for varlen)
    gathered:  (N, 2, B, Hkv, L, D)      every rank's, rank-major
    global:    (2, B, Hkv, S, D)         K and V in token order (one index_select; none for the
                                         contiguous layout, whose rank-major order is token order)
Every reordering is one indexed copy with an index built once per plan (by value) and device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..comm.collectives import all_gather_kv, exchange_rows, reduce_scatter_dkv
from ..kernels import Kernel, VarlenSeqs, acc_dtype
from ..kernels.base import int32_rows, landed, seq_slice
from ..plan import AllGatherPlan, VarlenPlan
from .rowsum import RowSources, row_sources, sum_rows_into


def bounded_put(cache: dict, key, value, limit: int = 64):
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


# ---- per task -----------------------------------------------------------------------------------
_ORDERS: dict = {}


def _orders(plan: AllGatherPlan, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(to_global, to_rank_major): int64 indices along the sequence with
    global[g] = rank_major[to_global[g]] and rank_major[i] = global[to_rank_major[i]];
    (None, None) when the two orders are the same (contiguous layout)."""
    key = (plan.pieces, plan.local_len, device)
    cached = _ORDERS.get(key)
    if cached is None:
        l_len = plan.local_len
        to_global = torch.cat([torch.arange(rank * l_len + lo, rank * l_len + hi) for rank, lo, hi in plan.pieces])
        if torch.equal(to_global, torch.arange(plan.seq_len)):
            cached = (None, None)
        else:
            to_rank_major = torch.empty_like(to_global)
            to_rank_major[to_global] = torch.arange(plan.seq_len)
            cached = (to_global.to(device), to_rank_major.to(device))
        bounded_put(_ORDERS, key, cached)
    return cached


def _packed(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one tensor, for one collective: stacked, (2, B, H, L, D), when their shapes match;
    else side by side along the head dim, (1, B, H, L, D + Dv) (a value head dim of its own, MLA)."""
    return torch.stack((k, v)) if k.shape == v.shape else torch.cat((k, v), dim=-1).unsqueeze(0)


def _unpacked(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _packed (views): (K, V) from (2, ..., D) or (1, ..., D + Dv)."""
    return (kv[0], kv[1]) if kv.shape[0] == 2 else (kv[0][..., :d], kv[0][..., d:])


#: a sequence in at most this many pieces (zigzag: 2N) goes between rank-major and token order
#: piece by piece, one strided copy each: one pass over the tensor where a rank-major reshape and
#: an index_select made two (more pieces, Balanced or DocZigzag: the indexed copy)
PIECEWISE = 64


def gather_kv(k, v, pg, plan: AllGatherPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K (B, Hkv, S, D) and V (B, Hkv, S, Dv), in global token order."""
    send = _packed(k, v)
    parts, b, h, l_len, e = send.shape
    n = plan.world_size
    gathered = all_gather_kv(send, pg, n).view(n, parts, b, h, l_len, e)
    to_global, _ = _orders(plan, k.device)
    if to_global is not None and len(plan.pieces) <= PIECEWISE:
        kv = gathered.new_empty((parts, b, h, n * l_len, e))
        g = 0
        for rank, lo, hi in plan.pieces:  # (N, P, B, Hkv, L, E) -> (P, B, Hkv, S, E), token order
            kv[:, :, :, g:g + hi - lo].copy_(gathered[rank, :, :, :, lo:hi])
            g += hi - lo
        return _unpacked(kv, k.shape[-1])
    # (N, P, B, Hkv, L, E) -> (P, B, Hkv, N*L, E), rank-major along the sequence
    kv = gathered.permute(1, 2, 3, 0, 4, 5).reshape(parts, b, h, n * l_len, e)
    return _unpacked(kv if to_global is None else kv.index_select(3, to_global), k.shape[-1])


def _rank_major(dkv_all: torch.Tensor, plan: AllGatherPlan) -> torch.Tensor:
    """(P, B, Hkv, S, E) in token order -> (N * P, B, Hkv, L, E), rank first: what the
    reduce-scatter sends (a copy)."""
    parts, b, h, _, e = dkv_all.shape
    n, l_len = plan.world_size, plan.local_len
    _, to_rank_major = _orders(plan, dkv_all.device)
    if to_rank_major is not None and len(plan.pieces) <= PIECEWISE:
        send = dkv_all.new_empty((n, parts, b, h, l_len, e))
        g = 0
        for rank, lo, hi in plan.pieces:
            send[rank, :, :, :, lo:hi].copy_(dkv_all[:, :, :, g:g + hi - lo])
            g += hi - lo
        return send.view(n * parts, b, h, l_len, e)
    if to_rank_major is not None:
        dkv_all = dkv_all.index_select(3, to_rank_major)
    return dkv_all.view(parts, b, h, n, l_len, e).permute(3, 0, 1, 2, 4, 5).reshape(n * parts, b, h, l_len, e)


def allgather_forward(q, k, v, pg, plan: AllGatherPlan, kernel: Kernel, scale: float, keep_kv: bool = False,
                      softcap=None, sink=None):
    """q: (B, Hq, L, D), k: (B, Hkv, L, D), v: (B, Hkv, L, Dv), this rank's shards; sink (Hq,) or
    None, which the kernel adds (each row is one kernel call: no merge). Returns out
    (B, Hq, L, Dv) in q.dtype, lse (B, Hq, L) float32 (float64 for float64) and, with keep_kv, the
    gathered (K, V) for allgather_backward (else None)."""
    acc = acc_dtype(q.dtype)
    kv = gather_kv(k, v, pg, plan)
    outs, lses = [], []
    for task in plan.tasks:
        ks = seq_slice(task.k_start, task.k_end)
        o, l = kernel.forward(q[seq_slice(task.q_start, task.q_end)], kv[0][ks], kv[1][ks], task.lo, task.hi, scale,
                              softcap=softcap, sink=sink)
        outs.append(o)
        lses.append(l)
    gathered = kv if keep_kv else None
    if plan.rows_tiled:
        # Contiguous, as the op's fake promises (cat makes a fresh tensor; a lone task's output
        # may be a transposed view).
        if len(outs) == 1:
            return outs[0].to(q.dtype).contiguous(), lses[0].to(acc).contiguous(), gathered
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).to(acc), gathered
    # Rows in no task see no key (padding under a document mask): out 0 and lse 0, as the ring.
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:-1], dtype=acc, device=q.device)
    for task, o, l in zip(plan.tasks, outs, lses):
        qs = seq_slice(task.q_start, task.q_end)
        out[qs] = o
        lse[qs] = l
    return out, lse, gathered


def allgather_backward(dout, q, k, v, out, lse, pg, plan: AllGatherPlan, kernel: Kernel, scale: float,
                       kv: Optional[tuple] = None, softcap=None, kv_dtype=None):
    """Gradients of allgather_forward, given its final out and lse (kv: the (K, V) it gathered and
    kept, or None to gather again). Returns dq, dk, dv in the input dtypes, or dk and dv (float32
    sums) in `kv_dtype`: not rounded for a caller that sums them again (route.py `_heads_backward`)."""
    acc = acc_dtype(q.dtype)
    b, h, _, d = k.shape
    if kv is None:
        kv = gather_kv(k, v, pg, plan)
    parts = 2 if k.shape == v.shape else 1
    # The tasks' dK/dV summed over the global keys in float32: each key's first share copied in,
    # later ones added (plan.key_writes), not added onto zeros. The keys no task sees are zeroed:
    # where they are most of the sequence (contiguous ranks before the last, windows), by one fill
    # of the whole buffer, which ran about twice as fast per byte as a fill of the parts (slices
    # of every head, on one H200: a window's all-gather at 32/32 heads lost 1 ms to them).
    writes, uncovered = plan.key_writes
    fill_all = 2 * sum(c - a for a, c in uncovered) > plan.seq_len
    dkv_all = (torch.zeros if fill_all else torch.empty)(
        (parts, b, h, plan.seq_len, d if parts == 2 else d + v.shape[-1]), dtype=acc, device=k.device)
    dk_all, dv_all = _unpacked(dkv_all, d)
    dqs = []
    for task, runs in zip(plan.tasks, writes):
        qs, ks = seq_slice(task.q_start, task.q_end), seq_slice(task.k_start, task.k_end)
        dq_t, dk_t, dv_t = kernel.backward(dout[qs], q[qs], kv[0][ks], kv[1][ks], out[qs], lse[qs],
                                           task.lo, task.hi, scale, softcap=softcap)
        dqs.append(dq_t)
        for a, c, first in runs:
            dst, src = seq_slice(a, c), seq_slice(a - task.k_start, c - task.k_start)
            if first:
                dk_all[dst].copy_(dk_t[src])
                dv_all[dst].copy_(dv_t[src])
            else:
                dk_all[dst].add_(dk_t[src])
                dv_all[dst].add_(dv_t[src])
        del dk_t, dv_t
    for a, c in () if fill_all else uncovered:
        dkv_all[:, :, :, a:c].zero_()
    del kv, dk_all, dv_all
    if plan.rows_tiled:
        dq = (dqs[0].contiguous() if len(dqs) == 1 else torch.cat(dqs, dim=2)).to(q.dtype)
    else:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        for task, dq_t in zip(plan.tasks, dqs):
            dq[seq_slice(task.q_start, task.q_end)] = dq_t
    # Global order -> rank-major, rank first for the reduce-scatter: (N * P, B, Hkv, L, E).
    send = _rank_major(dkv_all, plan)
    del dkv_all
    dk, dv = _unpacked(reduce_scatter_dkv(send, pg, plan.world_size), d)
    # copy=True: fresh dk and dv even when no cast is needed (outputs must not alias each other)
    return dq, dk.to(kv_dtype or k.dtype, copy=True), dv.to(kv_dtype or v.dtype, copy=True)


# ---- one varlen call --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Packing:
    seqs: VarlenSeqs
    key_rank: torch.Tensor  # (T_k,) rank holding each packed key
    key_row: torch.Tensor  # (T_k,) its index into that rank's B*L token rows
    dk_row: torch.Tensor  # (T_k,) its dK row in the flat (N * 2 * B*L, Hkv, D) reduce-scatter buffer
    dv_row: torch.Tensor  # (T_k,) its dV row there
    # One rank, and the sequences take every key once, in order (Ulysses' local attention after
    # its head exchange, documents whole): the packed keys *are* the rank's rows, so K/V go to the
    # kernel as views and its dK/dV come back as the gradients (one share per key: the float32
    # sum of the general path would hold the same values). The general path's gather, float32
    # buffer, indexed accumulate and copies took 25-35% of a log-normal Ulysses pass on one H100.
    identity: bool = False
    # the same mapping by destination (exec/rowsum.py): which packed rows each (rank, row) sums
    sources: Optional[RowSources] = None
    # Only the keys other ranks read move (plan.exchange, a KeyExchange), None: the whole shards.
    # The keys lie in a pool of P = B*L + R rows: this rank's own rows, then the R it received,
    # rank by rank. pool_row (T_k,): each packed key's row there. Both passes lay the pool out
    # (P, 2, Hkv, D), a row's K and V (dK and dV) side by side, so that the rows that move are one
    # contiguous span each way: dk_row / dv_row are 2 * pool_row and 2 * pool_row + 1 of the flat
    # (2P, Hkv, D) float32 buffer.
    pool_row: Optional[torch.Tensor] = None
    pool_rows: int = 0
    send_row: Optional[torch.Tensor] = None  # (S,) this rank's rows it sends, destination by destination
    send_splits: tuple[int, ...] = ()  # rows to each rank
    recv_splits: tuple[int, ...] = ()  # rows from each rank
    moves: bool = False  # whether any rank moves any row (else no collective on any rank)


_PACKINGS: dict = {}


def _packing(plan: VarlenPlan, device: torch.device) -> _Packing:
    """Index tensors for `plan`, built once per plan object and device: every layer of a model step
    shares the route's plan (hashing a plan by value would cost a pass over all its tasks per call;
    the entry holds the plan, so an id is never reused for another plan while it is cached)."""
    key = (id(plan), device)
    hit = _PACKINGS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    l_len = plan.local_len
    # global position g -> (owning rank, local index there)
    pieces = plan.rows[0].pieces
    owner = torch.cat([torch.full((hi - lo,), rank, dtype=torch.int64) for rank, lo, hi in pieces])
    local = torch.cat([torch.arange(lo, hi) for _, lo, hi in pieces])
    cu_q, cu_k, key_rank, key_row = [0], [0], [], []
    for b, row_plan in enumerate(plan.rows):
        for t in row_plan.tasks:
            cu_q.append(cu_q[-1] + t.q_len)
            cu_k.append(cu_k[-1] + t.k_len)
            key_rank.append(owner[t.k_start:t.k_end])
            key_row.append(b * l_len + local[t.k_start:t.k_end])
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    seqs = VarlenSeqs(tuple(cu_q), tuple(cu_k), *int32_rows([cu_q, cu_k], device), max_q, max_k)
    key_rank, key_row = torch.cat(key_rank), torch.cat(key_row)
    rows_per_rank = len(plan.rows) * l_len
    if plan.exchange is not None and plan.world_size > 1:
        packing = _exchange_packing(plan, seqs, key_rank, key_row, rows_per_rank, device)
        bounded_put(_PACKINGS, key, (plan, packing))
        return packing
    dk_row = key_rank * (2 * rows_per_rank) + key_row
    identity = plan.world_size == 1 and torch.equal(key_row, torch.arange(rows_per_rank))
    # (only where the Triton sum can run: on the device, no host sort)
    sources = None if identity or device.type != "cuda" else row_sources(
        key_rank * rows_per_rank + key_row, plan.world_size * rows_per_rank, rows_per_rank, device)
    packing = _Packing(seqs, key_rank.to(device), key_row.to(device), dk_row.to(device),
                       (dk_row + rows_per_rank).to(device), identity, sources)
    bounded_put(_PACKINGS, key, (plan, packing))
    return packing


def _rows_of(ranges) -> torch.Tensor:
    """(lo, hi) ranges -> their rows, int64."""
    if not ranges:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(lo, hi) for lo, hi in ranges])


def _exchange_packing(plan: VarlenPlan, seqs: VarlenSeqs, key_rank: torch.Tensor, key_row: torch.Tensor,
                      rows_per_rank: int, device: torch.device) -> _Packing:
    """The packing where only the keys other ranks read move (plan.exchange): each packed key's
    row in the pool (own rows, then the received ones rank by rank), and what goes where."""
    exchange, me = plan.exchange, plan.rank
    fetched = [_rows_of(ranges) for ranges in exchange.fetch]
    sent = [_rows_of(ranges) for ranges in exchange.serve]
    pool_row = key_row.clone()
    start = rows_per_rank
    for owner, rows in enumerate(fetched):
        theirs = key_rank == owner
        if owner != me and rows.numel():
            at = torch.searchsorted(rows, key_row[theirs])
            if not torch.equal(rows[at.clamp(max=rows.numel() - 1)], key_row[theirs]):  # (a planning bug)
                raise AssertionError(f"rank {me}: a key of rank {owner} it reads is not in its KeyExchange")
            pool_row[theirs] = start + at
        elif owner != me and bool(theirs.any()):
            raise AssertionError(f"rank {me}: reads keys of rank {owner} that its KeyExchange does not fetch")
        start += rows.numel()
    pool_rows = start
    # (rows_per_rank 1: slot p's dK row is 2p and its dV row 2p + 1, the (P, 2, Hkv, D) layout)
    sources = None if device.type != "cuda" else row_sources(pool_row, pool_rows, 1, device)
    send_row = torch.cat(sent)
    return _Packing(seqs, key_rank.to(device), key_row.to(device), (2 * pool_row).to(device),
                    (2 * pool_row + 1).to(device), False, sources, pool_row.to(device), pool_rows,
                    send_row.to(device), tuple(r.numel() for r in sent), tuple(r.numel() for r in fetched),
                    exchange.moves)


def _pack_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*L, H, D): the query rows of the sequences, in order. One batch row (packed
    documents, the usual case) is a view: the varlen kernels take rows with any strides whose last
    dim is contiguous (as the ring's fused steps pass them), and a copy cost as much as a quarter of
    a long-tailed batch's pass (H100, 16K rows x 32 heads: ~0.4 ms per tensor, three per backward)."""
    b, h, l_len, d = x.shape
    if b == 1:
        return x[0].transpose(0, 1)
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


def gather_packed_kv(k, v, pg, plan: VarlenPlan, packing: _Packing):
    """(2, T_k, Hkv, D), or a pair of (T_k, Hkv, D) tensors or views (identity packing; only the
    keys other ranks read moved): the keys and values of every sequence, back to back."""
    if packing.identity:
        return _pack_rows(k), _pack_rows(v)
    b, h, l_len, d = k.shape
    n = plan.world_size
    if packing.pool_row is not None:  # only the keys other ranks read move
        if not packing.moves:  # (the pool is the rank's own rows: each packed key read from them once)
            return (_pack_rows(k).index_select(0, packing.pool_row), _pack_rows(v).index_select(0, packing.pool_row))
        # The pool (P, 2, Hkv, D): the rank's rows written once, the received ones landing in place
        # (their all-to-all writes the pool's tail), then each packed key read once. K and V go to
        # the kernel as views of rows 2 * Hkv * D apart. (A stack of the own rows, a cat with the
        # received ones and an index cost 1.7 ms of an 11 ms all-gather pass: Pareto s1, 8 ranks.)
        own = b * l_len
        pool = torch.empty((packing.pool_rows, 2, h, d), dtype=k.dtype, device=k.device)
        pool[:own, 0].view(b, l_len, h, d).copy_(k.transpose(1, 2))
        pool[:own, 1].view(b, l_len, h, d).copy_(v.transpose(1, 2))
        send = pool[:own].index_select(0, packing.send_row)  # (S, 2, Hkv, D), destination by destination
        exchange_rows(send, packing.send_splits, packing.recv_splits, pg, "kv", out=pool[own:])
        packed = pool.index_select(0, packing.pool_row)  # (T_k, 2, Hkv, D)
        return packed[:, 0], packed[:, 1]
    gathered = all_gather_kv(torch.stack((k.transpose(1, 2), v.transpose(1, 2))), pg, n)  # (N*2, B, L, Hkv, D)
    # (N, 2, B*L, Hkv, D) -> (2, N, B*L, Hkv, D) view; one gather picks every packed key
    return gathered.view(n, 2, b * l_len, h, d).transpose(0, 1)[:, packing.key_rank, packing.key_row]


def varlen_forward(q, k, v, pg, plan: VarlenPlan, kernel: Kernel, scale: float, keep_kv: bool = False,
                   softcap=None, sink=None):
    """q: (B, Hq, L, D), k/v: (B, Hkv, L, D), this rank's shards (K and V of one shape: routes take
    per-task plans otherwise); sink (Hq,) or None, added by the kernel. Returns out (B, Hq, L, D) in
    q.dtype, lse (B, Hq, L) float32 (float64 for float64) and, with keep_kv, the packed K/V for
    varlen_backward (else None)."""
    packing = _packing(plan, q.device)
    kv = gather_packed_kv(k, v, pg, plan, packing)
    if q.shape[0] == 1:  # packed documents, the usual case: the launch writes the results themselves
        out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
        into = (_pack_rows(out), lse[0])
        landed(kernel.varlen_forward_into(_pack_rows(q), kv[0], kv[1], packing.seqs, plan.window, scale, *into,
                                           softcap=softcap, sink=sink), into)
        return out, lse, (kv if keep_kv else None)
    out, lse = kernel.varlen_forward(_pack_rows(q), kv[0], kv[1], packing.seqs, plan.window, scale, softcap=softcap,
                                     sink=sink)
    out, lse = _unpack_rows(out, q.shape, q.dtype), _unpack_lse(lse, q.shape[:-1], acc_dtype(q.dtype))
    return out, lse, (kv if keep_kv else None)


def varlen_backward(dout, q, k, v, out, lse, pg, plan: VarlenPlan, kernel: Kernel, scale: float,
                    kv=None, softcap=None, kv_dtype=None):
    """Gradients of varlen_forward (kv: the packed K/V it gathered and kept, as `gather_packed_kv`
    gives them: a (2, T_k, Hkv, D) tensor or a pair of (T_k, Hkv, D) ones; None to gather again).
    Returns dq, dk, dv in the input dtypes, or dk and dv sums in `kv_dtype` (allgather_backward's)."""
    acc = acc_dtype(q.dtype)
    b, h, l_len, d = k.shape
    n = plan.world_size
    packing = _packing(plan, q.device)
    if kv is None:
        kv = gather_packed_kv(k, v, pg, plan, packing)
    # One batch row: the launch writes dQ (and, one rank's own keys, dK/dV) into the results
    # themselves, (1, H, L, D) tensors seen as rows, instead of returning packed ones to copy.
    into = {}
    if b == 1:
        into["dq"] = _pack_rows(torch.empty(q.shape, dtype=q.dtype, device=q.device))
        if packing.identity and kv_dtype is None:
            into["dk"] = _pack_rows(torch.empty(k.shape, dtype=k.dtype, device=k.device))
            into["dv"] = _pack_rows(torch.empty(v.shape, dtype=v.dtype, device=v.device))
    got = kernel.varlen_backward_into(
        _pack_rows(dout), _pack_rows(q), kv[0], kv[1], _pack_rows(out), _pack_lse(lse), packing.seqs, plan.window,
        scale, softcap=softcap, **into,
    )
    dq, dk, dv = landed(got, tuple(into.get(name) for name in ("dq", "dk", "dv")))
    del kv, got
    dq = _rows_result(dq, q, b == 1)
    if packing.identity:  # each key's one share, in the rank's own order
        if kv_dtype is not None:  # (the kernel's own dtype widened, not rounded to the inputs' first)
            return dq, _unpack_rows(dk, k.shape, kv_dtype), _unpack_rows(dv, v.shape, kv_dtype)
        return dq, _rows_result(dk, k, b == 1), _rows_result(dv, v, b == 1)
    if packing.pool_row is not None:  # only the keys other ranks read moved
        return dq, *_exchanged_dkv(dk, dv, k, v, pg, packing, kv_dtype)
    # Sum the sequences' shares per key (a key two sequences share appears twice) in float32,
    # straight into the rank-major layout the reduce-scatter sends: one Triton kernel on CUDA, each
    # row written once (exec/rowsum.py); else a zero fill and indexed accumulates. (Into the flat
    # contiguous view: index_put_ on a strided view clones it and copies it back.)
    dkv = torch.empty((n, 2, b * l_len, h, d), dtype=acc, device=k.device)
    sum_rows_into(dkv.view(n * 2 * b * l_len, h, d), dk, dv, packing.sources, packing.dk_row, packing.dv_row)
    del dk, dv
    mine = reduce_scatter_dkv(dkv.view(n * 2, b, l_len, h, d), pg, n)
    return (dq, _contiguous(mine[0].transpose(1, 2), kv_dtype or k.dtype),
            _contiguous(mine[1].transpose(1, 2), kv_dtype or v.dtype))


def _exchanged_dkv(dk, dv, k, v, pg, packing: _Packing, kv_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of this rank's keys from the launch's packed shares (T_k, Hkv, D), where only the
    keys other ranks read moved: the shares summed per pool row in float32 (a (P, 2, Hkv, D)
    buffer: each row's dK and dV side by side), the received rows' sums sent back to their ranks
    (the buffer's tail as it lies), and the sums of this rank's rows that other ranks read added
    in (float32, one indexed accumulate). Laid out (2, P, ...), the tail took a copy to send and
    the sums coming back a cat: 0.43 ms of an 11 ms pass (Pareto s1, 8 ranks, one H200)."""
    b, h, l_len, d = k.shape
    own, pool = b * l_len, packing.pool_rows
    dkv = torch.empty((pool, 2, h, d), dtype=acc_dtype(k.dtype), device=k.device)
    sum_rows_into(dkv.view(2 * pool, h, d), dk, dv, packing.sources, packing.dk_row, packing.dv_row)
    del dk, dv
    if packing.moves:  # (R, 2, Hkv, D) to the ranks the rows came from; (S, 2, Hkv, D) back
        got = exchange_rows(dkv[own:], packing.recv_splits, packing.send_splits, pg, "grad")
        if got.shape[0]:  # (deterministic: the sorted accumulate)
            dkv.index_put_((packing.send_row,), got, accumulate=True)
    return (_contiguous(dkv[:own, 0].view(b, l_len, h, d).transpose(1, 2), kv_dtype or k.dtype),
            _contiguous(dkv[:own, 1].view(b, l_len, h, d).transpose(1, 2), kv_dtype or v.dtype))


def _rows_result(grad: torch.Tensor, like: torch.Tensor, written: bool) -> torch.Tensor:
    """A gradient shaped like `like` (B, H, L, D): the (1, H, L, D) result the launch wrote into
    (`grad` is its rows view), else the packed rows unpacked into a fresh tensor."""
    if written:
        return grad.transpose(0, 1).unsqueeze(0)  # the rows view's own tensor: (1, H, L, D), contiguous
    return _unpack_rows(grad, like.shape, like.dtype)
