"""N ranks in one process (dtcp.comm.simulated): each rank's real plan, kernel calls and received
data, on one device, for the ring, the all-gather and Ulysses. Shared by the CPU check of the
harness (tests/test_simulated_ring.py) and the one-GPU exactness test
(tests/gpu/test_one_gpu_ranks.py)."""

from __future__ import annotations

import threading

import torch

from dtcp.comm.simulated import SimulatedRing, locked
from dtcp.exec.ring import ring_backward, ring_forward
from dtcp.plan import AttnMask, ring_plans


def segments_of(docs):
    out, pos = [], 0
    for n in docs:
        out.append((pos, pos + n))
        pos += n
    return tuple(out)


def simulated_ring(layout, n, q, k, v, dout, kernel, *, is_causal=True, window=(-1, -1), docs=None, scale=None,
                   kv_dtype=None):
    """Full tensors q, k, v, dout (1, H, S, D) -> (out, lse, dq, dk, dv) in global token order,
    computed by N simulated ranks of the ring (each rank's shards, plan and kernel calls).
    `kv_dtype`: ring_backward's (dk and dv in it)."""
    s = q.shape[2]
    local_len = s // n
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    mask = AttnMask.make(is_causal, window, None if docs is None else segments_of(docs))
    plans = ring_plans(layout, local_len, n, is_causal, mask)
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r).to(t.device)).contiguous()  # noqa: E731
    kern = locked(kernel)
    from dtcp.exec.route import ring_steps
    # as the route runs it: in groups where dtcp.config.ring_steps_per_launch asks for them (or,
    # with "auto", where the cost model chooses them)
    size = ring_steps(plans, kernel, *(t[:, :, :local_len] for t in (q, k, v)), n)

    def rank_fn(r, comm):
        from dtcp.exec.grouped import grouped, grouped_backward, grouped_forward
        qr, kr, vr, dr = (shard(t, r) for t in (q, k, v, dout))
        if grouped(plans[r], kern, size):
            out, lse = grouped_forward(qr, kr, vr, plans[r], kern, scale, comm, size=size)
            dq, dk, dv = grouped_backward(dr, qr, kr, vr, out, lse, plans[r], kern, scale, comm, kv_dtype=kv_dtype,
                                          size=size)
        else:
            out, lse = ring_forward(qr, kr, vr, plans[r], kern, scale, comm)
            dq, dk, dv = ring_backward(dr, qr, kr, vr, out, lse, plans[r], kern, scale, comm, kv_dtype=kv_dtype)
        return out, lse, dq, dk, dv

    results = SimulatedRing(n).run(rank_fn)
    return in_token_order(results, layout, n)


def _allgather_ranks(shards, gathered, run_rank):
    """Each rank's `run_rank(q, k, v, dout) -> [out, lse, dq]` on its shards, with the
    all-gather's collectives carrying the real data: the all-gather gives `gathered` (every
    rank's stacked K/V, rank-major) and every reduce-scatter's send is recorded. Returns the
    results and, per rank, the sum of every rank's share for it (2, ...) float32: what the
    reduce-scatter returns once all have sent."""
    from dtcp.exec import allgather as ag

    n, shares = len(shards), []

    def reduce_scatter(send, pg, world_size):
        shares.append(send)
        return torch.zeros_like(send[: send.shape[0] // world_size])

    saved = ag.all_gather_kv, ag.reduce_scatter_dkv
    ag.all_gather_kv, ag.reduce_scatter_dkv = (lambda send, pg, world_size: gathered), reduce_scatter
    try:
        results = [run_rank(*shard) for shard in shards]
    finally:
        ag.all_gather_kv, ag.reduce_scatter_dkv = saved
    return results, [sum(share.view(n, 2, *share.shape[1:])[r] for share in shares) for r in range(n)]


def simulated_allgather_tasks(layout, n, q, k, v, dout, kernel, *, is_causal=True, window=(-1, -1), docs=None,
                              scale=None):
    """As simulated_allgather, for the all-gather task by task (`AllGatherPlan`: causal zigzag,
    windows; dtcp/exec/allgather.py allgather_forward/allgather_backward): every rank's K/V
    gathered for real, each rank's dK/dV the sum of every rank's reduce-scatter share of it."""
    from dtcp.exec import allgather as ag
    from dtcp.plan import allgather_plans

    s = q.shape[2]
    local_len = s // n
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    mask = AttnMask.make(is_causal, window, None if docs is None else segments_of(docs))
    plans = iter(allgather_plans(layout, local_len, n, is_causal, mask))
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r).to(t.device)).contiguous()  # noqa: E731
    shards = [[shard(t, r) for t in (q, k, v, dout)] for r in range(n)]
    gathered = torch.cat([torch.stack((kr, vr)) for _, kr, vr, _ in shards])  # (N * 2, B, Hkv, L, D), rank-major

    def run_rank(qr, kr, vr, dr):
        plan = next(plans)
        out, lse, kept = ag.allgather_forward(qr, kr, vr, None, plan, kernel, scale, keep_kv=True)
        dq, _, _ = ag.allgather_backward(dr, qr, kr, vr, out, lse, None, plan, kernel, scale, kv=kept)
        return [out, lse, dq]

    results, mine = _allgather_ranks(shards, gathered, run_rank)
    for res, dkv in zip(results, mine):  # (2, B, Hkv, L, D) float32
        res += [dkv[0].to(k.dtype), dkv[1].to(v.dtype)]
    return in_token_order(results, layout, n)


def simulated_allgather(layout, n, q, k, v, dout, kernel, *, is_causal=True, window=(-1, -1), docs=None, scale=None,
                        exchange=True, kv_dtype=None):
    """As simulated_ring, for the all-gather schedule as one varlen call per rank (documents:
    dtcp/exec/allgather.py varlen_forward/varlen_backward), one thread per rank. With `exchange`
    (dtcp.config.allgather_exchange, the default) each rank's plan moves only the keys other
    ranks read (plan.KeyExchange, as the route builds it), and the exchanges carry every rank's
    real rows both ways; without it the all-gather gives every rank's K/V and each rank's dK/dV is
    the sum of every rank's share of it, as a reduce-scatter returns it."""
    from dtcp.exec import allgather as ag
    from dtcp.plan import VarlenPlan, allgather_plans, varlen_plans, varlen_reason

    s = q.shape[2]
    local_len = s // n
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    mask = AttnMask.make(is_causal, window, None if docs is None else segments_of(docs))
    rank_rows = [(p,) for p in allgather_plans(layout, local_len, n, is_causal, mask)]
    plans = (varlen_plans(rank_rows, mask.band.window) if exchange
             else [VarlenPlan(rows, mask.band.window) for rows in rank_rows])
    assert all(p.rows_tiled for p in plans) and varlen_reason([t for p in plans for t in p.tasks],
                                                               mask.band.window) is None
    why = kernel.reject_varlen_reason([sl for p in plans for sl in p.seq_lens], mask.band.window)
    if why is not None:  # the route would not take this kernel for the call
        raise NotImplementedError(why)
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r).to(t.device)).contiguous()  # noqa: E731
    shards = [[shard(t, r) for t in (q, k, v, dout)] for r in range(n)]
    if not exchange and kv_dtype is not None:
        raise NotImplementedError("kv_dtype with exchange=False (the simulated reduce-scatter casts itself)")
    if not exchange:
        gathered = torch.cat([torch.stack((kr.transpose(1, 2), vr.transpose(1, 2))) for _, kr, vr, _ in shards])
        ranks = iter(plans)

        def run_rank(qr, kr, vr, dr):
            plan = next(ranks)
            out, lse, _ = ag.varlen_forward(qr, kr, vr, None, plan, kernel, scale)
            dq, _, _ = ag.varlen_backward(dr, qr, kr, vr, out, lse, None, plan, kernel, scale)
            return [out, lse, dq]

        results, mine = _allgather_ranks(shards, gathered, run_rank)
        for res, dkv in zip(results, mine):  # (2, B, L, Hkv, D) float32
            res += [dkv[0].transpose(1, 2).to(k.dtype), dkv[1].transpose(1, 2).to(v.dtype)]
        return in_token_order(results, layout, n)
    rows = _ExchangeRows(n)
    kern = locked(kernel)

    def rank_fn(r, _comm):
        qr, kr, vr, dr = shards[r]
        try:  # (the rank goes where the process group goes: the simulated exchange reads it)
            out, lse, _ = ag.varlen_forward(qr, kr, vr, r, plans[r], kern, scale)
            dq, dk, dv = ag.varlen_backward(dr, qr, kr, vr, out, lse, r, plans[r], kern, scale, kv_dtype=kv_dtype)
        except BaseException:
            rows.barrier.abort()
            raise
        return out, lse, dq, dk, dv

    return in_token_order(_threads_with(n, rank_fn, ag, "exchange_rows", rows), layout, n)


class _AllToAll:
    """The all-to-all of `n` simulated ranks (dtcp/comm/collectives.py all_to_all_bytes' contract:
    (U, row) uint8 -> (U, row), row j of the result is rank j's row for this rank), the rank passed
    where the process group goes. Each call waits for every rank's send; a failing rank breaks the
    barrier (`abort`), so the others raise instead of waiting."""

    what = "all-to-all"

    def __init__(self, n: int, timeout_s: float = 300.0):
        self.n, self.sends = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def __call__(self, send, rank, world_size):
        assert world_size == self.n
        return self._round(rank, send.clone(), lambda: torch.stack([self.sends[j][rank] for j in range(self.n)]))

    def _round(self, rank: int, payload, read):
        """Post this rank's `payload`, then `read()` once every rank has posted."""
        self.sends[rank] = payload
        try:
            self.barrier.wait()
            got = read()
            self.barrier.wait()  # every rank has read before the next call overwrites a send
        except threading.BrokenBarrierError as e:  # (SimulatedRing.run then raises the failing rank's error)
            raise RuntimeError(f"simulated {self.what}: another rank failed") from e
        return got


class _ExchangeRows(_AllToAll):
    """dtcp/comm/collectives.py exchange_rows among `n` simulated ranks (the rank passed where the
    process group goes): rows send_rows[j] of a rank's send go to rank j, in rank order."""

    what = "exchange"

    def __call__(self, send, send_rows, recv_rows, rank, kind, out=None):
        assert len(send_rows) == len(recv_rows) == self.n and send.shape[0] == sum(send_rows)

        def read():
            parts = []
            for j, (theirs, splits) in enumerate(self.sends):
                start = sum(splits[:rank])
                assert splits[rank] == recv_rows[j], (rank, j, splits, recv_rows)  # the plans agree
                parts.append(theirs[start:start + splits[rank]])
            if out is not None:  # (received into the caller's buffer, as the all-to-all writes it)
                assert out.is_contiguous() and tuple(out.shape) == (sum(recv_rows),) + tuple(send.shape[1:])
                return torch.cat(parts, out=out)
            return torch.cat(parts)

        return self._round(rank, (send.clone(), send_rows), read)


def simulated_ulysses(layout, n, q, k, v, dout, kernel, *, is_causal=True, window=(-1, -1), docs=None, scale=None,
                      keep=False):
    """As simulated_ring, for strategy="ulysses": each rank's route as dtcp builds it (dtcp/exec/
    route.py `_heads_route`: the head exchange and, for the rank's heads, the whole sequence as
    one local call on `kernel`), run by the route's own forward and backward (`_heads_forward`,
    `_heads_backward`), one thread per rank; the all-to-alls deliver every rank's real bytes.
    keep=False is the custom op's backward (the forward's tensors exchanged again, with dout),
    keep=True the eager path's (the exchanged tensors kept). NotImplementedError where the route
    would not take `kernel` for these shapes."""
    from types import SimpleNamespace

    from dtcp.api import op_layout
    from dtcp.exec import route as R
    from dtcp.exec import ulysses as ul

    s = q.shape[2]
    local_len = s // n
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    cu = None if docs is None else tuple([0] + [sum(docs[:i + 1]) for i in range(len(docs))])
    spec, cu = op_layout(layout, cu)  # (as dtcp.explain derives the op's arguments)
    args = R.CallArgs("", spec, is_causal, scale, kernel.name, window[0], window[1], "ulysses")
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r).to(t.device)).contiguous()  # noqa: E731
    shards = [[shard(t, r) for t in (q, k, v, dout)] for r in range(n)]
    routes = []
    for r, (qr, kr, vr, _) in enumerate(shards):
        problem = R._problem(qr, args, cu, SimpleNamespace(size=n, rank=r), None)
        try:
            _, heads, plan, kern = R._heads_route("ulysses", qr, kr, vr, args, problem, sinks=False)
        except ValueError as e:
            raise NotImplementedError(f"strategy='ulysses' with {kernel.name}: {e}") from e
        routes.append(SimpleNamespace(heads=heads, plan=plan, kernel=locked(kern), softcap=None, steps_per_launch=1,
                                      seq_state=None, comm_group=lambda: None, head_comm_group=lambda r=r: r))
    all_to_all = _AllToAll(n)

    def rank_fn(r, _comm):
        route, (qr, kr, vr, dr) = routes[r], shards[r]
        try:
            out, lse, kept = R._heads_forward(route, qr, kr, vr, scale, keep, None)
            dq, dk, dv, _ = R._heads_backward(route, dr, qr, kr, vr, out, lse, scale, kept, None)
        except BaseException:
            all_to_all.barrier.abort()
            raise
        return out, lse, dq, dk, dv

    return in_token_order(_threads_with(n, rank_fn, ul, "all_to_all_bytes", all_to_all), layout, n)


def _threads_with(n, rank_fn, module, name, collective):
    """Every rank's `rank_fn(rank, comm)` on a thread of its own (SimulatedRing), with `module.name`
    (the collective the code under test calls) replaced by the simulated `collective` meanwhile."""
    saved = getattr(module, name)
    setattr(module, name, collective)
    try:
        return SimulatedRing(n).run(rank_fn)
    finally:
        setattr(module, name, saved)


def in_token_order(results, layout, n):
    """Each rank's (out, lse, dq, dk, dv) shards, (1, H, L, ...) -> the whole (1, H, S, ...) in token order."""
    s = results[0][0].shape[2] * n
    perm = layout.permutation(s, n).to(results[0][0].device)
    merged = []
    for i in range(5):
        cat = torch.cat([res[i] for res in results], dim=2)
        full = torch.empty_like(cat)
        full[:, :, perm] = cat
        merged.append(full)
    return tuple(merged)
