"""The all-gather's varlen call moves only the keys other ranks read (plan.KeyExchange,
exec/allgather.py): packed documents mostly sit whole on one rank, and their keys need not leave it.

Pure Python: each rank's fetch and serve ranges are exactly the keys, found by brute force over the
mask, that its queries read on other ranks. Spawned gloo ranks, float64: out, lse, dq, dk, dv
against single-process attention to 1e-10, and the bytes sent are exactly those rows' (none, and
no collective, where every document sits on one rank)."""

from __future__ import annotations

import itertools

import pytest
import torch

import dtcp
from dist_harness import run_ranks
from dtcp.plan import AttnMask, allgather_plans, segments_from_cu_seqlens, varlen_plans
from reference import reference_attention, window_doc_mask
from test_window_varlen import sharded_errors

KEYS = ("out", "lse", "dq", "dk", "dv")


def layout_of(spec: str, docs):
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
    if spec.startswith("balanced"):
        min_chunk = dtcp.layout_from_spec(spec).min_chunk
        return dtcp.Balanced.from_cu_seqlens(cu, min_chunk=min_chunk)
    return dtcp.layout_from_spec(spec)


def brute_force_fetch(layout, n: int, rows_docs, window) -> list[list[set]]:
    """fetch[me][owner]: the flat rows (b * L + local index) of `owner` that `me`'s queries read,
    by the mask's definition, pair by pair."""
    s = sum(rows_docs[0])
    local_len = s // n
    owner_of, index_of = {}, {}
    for r in range(n):
        for i, g in enumerate(layout.global_positions(s, n, r).tolist()):
            owner_of[g], index_of[g] = r, i
    fetch = [[set() for _ in range(n)] for _ in range(n)]
    for b, docs in enumerate(rows_docs):
        mask = AttnMask.make(True, window, segments_from_cu_seqlens([0, *itertools.accumulate(docs)], s))
        for me in range(n):
            for p in layout.global_positions(s, n, me).tolist():
                for g in range(s):
                    if owner_of[g] != me and mask.visible(p, g):
                        fetch[me][owner_of[g]].add(b * local_len + index_of[g])
    return fetch


def rows_of(ranges) -> set:
    return {i for lo, hi in ranges for i in range(lo, hi)}


CASES = [  # (spec, world size, each batch row's documents, window)
    ("balanced@1", 4, [(40, 3, 3, 2, 9, 7)], (-1, 0)),  # the 40 cut in 8 chunks
    ("balanced@1", 4, [(40, 3, 3, 2, 9, 7)], (5, 0)),  # and a window
    ("balanced", 2, [(21, 3, 5, 3)], (-1, 0)),
    ("zigzag", 4, [(16, 8, 8, 8, 8, 8, 8)], (-1, 0)),  # one document over ranks 0 and 1 only
    ("zigzag", 2, [(3, 13), (9, 7)], (-1, 0)),  # two batch rows, their own documents
    ("contiguous", 4, [(8, 8, 8, 8)], (-1, 0)),  # every document on one rank: nothing moves
    ("contiguous", 8, [(16,) * 4], (2, 0)),
]


@pytest.mark.parametrize("spec,n,rows_docs,window", CASES, ids=[f"{c[0]}-n{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_the_exchange_is_exactly_the_keys_read_across_ranks(spec, n, rows_docs, window):
    s = sum(rows_docs[0])
    layout = layout_of(spec, rows_docs[0]) if len(rows_docs) == 1 else dtcp.layout_from_spec(spec)
    per_row = [allgather_plans(layout, s // n, n, True,
                               AttnMask.make(True, window, segments_from_cu_seqlens([0, *itertools.accumulate(d)], s)))
               for d in rows_docs]
    plans = varlen_plans([tuple(p[r] for p in per_row) for r in range(n)], window)
    expected = brute_force_fetch(layout, n, rows_docs, window)
    for me, plan in enumerate(plans):
        ex = plan.exchange
        assert [rows_of(r) for r in ex.fetch] == expected[me], (me, ex.fetch)
        assert [rows_of(r) for r in ex.serve] == [expected[j][me] for j in range(n)], (me, ex.serve)
        assert ex.fetched_rows == sum(len(x) for x in expected[me])
        for ranges in ex.fetch + ex.serve:  # sorted, disjoint, not touching
            assert all(a < b for a, b in ranges) and all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))
    moves = any(x for per in expected for x in per)
    assert all(p.exchange.moves == moves for p in plans)
    if spec == "contiguous" and window == (-1, 0):
        assert not moves


def exchanged_call(spec, rows_docs, window, d=8, heads=(4, 2), exchange=True):
    """On every rank: errors against one process, the exchange's rows, and the bytes the call's
    collectives sent, from one eager forward + backward with strategy="allgather" and the math
    kernel taken as a one-launch varlen kernel (the route FA4 and flash take on CUDA)."""
    import torch.distributed as dist

    from dtcp.comm import STATS
    from dtcp.exec.route import CallArgs, clear_routes, route_for
    from dtcp.kernels import KERNELS, default_scale

    n = dist.get_world_size()
    s = sum(rows_docs[0])
    b = len(rows_docs)
    layout = layout_of(spec, rows_docs[0]) if b == 1 else dtcp.layout_from_spec(spec)
    row_cus = [[0, *itertools.accumulate(docs)] for docs in rows_docs]
    cu_list = row_cus[0] if b == 1 else sorted({r * s + c for r, cu in enumerate(row_cus) for c in cu})
    cu = torch.tensor(cu_list, dtype=torch.int32)
    hq, hkv = heads
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for row, rcu in enumerate(row_cus):
        mask = window_doc_mask(s, is_causal=True, window=window, cu_seqlens=rcu)
        o, l = reference_attention(*(t[row:row + 1] for t in ref), mask=mask)
        outs.append(o)
        lses.append(l)
    out_ref, lse_ref = torch.cat(outs), torch.cat(lses).detach()
    out_ref.backward(dout)
    kernel = KERNELS["math"]
    saved = type(kernel).varlen_one_launch
    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    try:
        type(kernel).varlen_one_launch = True
        dtcp.config.allgather_exchange = exchange
        clear_routes()
        STATS.reset()
        out, lse = dtcp.ring_attention(*local, layout=layout, cu_seqlens=None if spec.startswith("balanced") else cu,
                                       is_causal=True, enable_gqa=True, window_size=window, backend="math",
                                       strategy="allgather", return_lse=True)
        forward = (STATS.kv_rounds, STATS.kv_bytes_sent)
        out.backward(layout.shard(dout, dim=2))
        sent = (STATS.kv_rounds, STATS.kv_bytes_sent, STATS.grad_rounds, STATS.grad_bytes_sent)
        args = CallArgs(dist.group.WORLD.group_name, layout.spec() if not spec.startswith("balanced")
                        else layout.op_spec(), True, default_scale(d), "math", *window, "allgather")
        plan = route_for(local[0], local[1], local[2], args, tuple(cu_list), "test").plan
    finally:
        type(kernel).varlen_one_launch = saved
        dtcp.config.allgather_exchange = True
        clear_routes()
    errors = sharded_errors(layout, (out, lse, *(t.grad for t in local)), (out_ref, lse_ref, *(t.grad for t in ref)))
    ex = plan.exchange
    moved = {} if ex is None else dict(served=ex.served_rows, fetched=ex.fetched_rows, moves=ex.moves)
    return {**errors, **moved, "plan": type(plan).__name__, "exchange": ex is not None, "forward": forward,
            "sent": sent, "row_bytes": 2 * hkv * d * 8, "local_rows": b * (s // n)}


@pytest.mark.parametrize("spec,n,rows_docs,window", CASES[:6], ids=[f"{c[0]}-n{c[1]}-{i}" for i, c in enumerate(CASES[:6])])
def test_only_the_keys_read_across_ranks_move_and_the_results_are_exact(spec, n, rows_docs, window):
    results = run_ranks(n, exchanged_call, spec, rows_docs, window)
    for r in results:
        for key in KEYS:
            assert r[key] < 1e-10, (key, r)
        assert r["plan"] == "VarlenPlan", r
        rounds = int(r["moves"])  # one exchange each way, or none at all
        # K/V go out once (the eager path keeps them for the backward); dK/dV of the fetched rows
        # go back in float64 (float32 for bf16 inputs)
        assert r["forward"] == (rounds, r["served"] * r["row_bytes"]), r
        assert r["sent"] == (rounds, r["served"] * r["row_bytes"], rounds, r["fetched"] * r["row_bytes"]), r
        # the plain all-gather sends the whole shard to N - 1 ranks
        assert r["served"] <= (n - 1) * r["local_rows"]
    if spec == "contiguous":
        assert not any(r["moves"] for r in results)
    else:
        assert sum(r["served"] for r in results) < (n - 1) * n * results[0]["local_rows"]
        assert all(r["moves"] for r in results)
    if spec == "zigzag" and n == 4:  # only rank 1 reads another rank's keys (rank 0's): ranks 2 and 3 send nothing
        assert [r["fetched"] for r in results] == [0, 8, 0, 0] and [r["served"] for r in results] == [8, 0, 0, 0]


def test_allgather_exchange_off_gathers_whole_shards():
    """dtcp.config.allgather_exchange = False: the plain all-gather and reduce-scatter, every
    rank's whole shard to the N - 1 others (a new route: the setting is in the route's key), with
    the same exact results."""
    n = 4
    for r in run_ranks(n, exchanged_call, "balanced@1", [(40, 3, 3, 2, 9, 7)], (-1, 0), exchange=False):
        for key in KEYS:
            assert r[key] < 1e-10, (key, r)
        assert r["plan"] == "VarlenPlan" and not r["exchange"], r
        whole = (n - 1) * r["local_rows"] * r["row_bytes"]
        assert r["sent"] == (1, whole, 1, whole), r


def exchange_setting_on_one_rank():
    """The last rank turns dtcp.config.allgather_exchange off (it would call an all-gather where
    the others call an all-to-all): every rank's outcome, then a matching call on the same group."""
    import time

    import torch.distributed as dist

    from dtcp.kernels import KERNELS

    n, r = dist.get_world_size(), dist.get_rank()
    docs = (40, 3, 3, 2, 9, 7)
    layout = layout_of("balanced@1", docs)
    g = torch.Generator().manual_seed(3)
    q, k, v = (layout.shard(torch.randn(1, h, sum(docs), 8, generator=g, dtype=torch.float64), dim=2)
               for h in (4, 2, 2))
    kernel = KERNELS["math"]
    saved = type(kernel).varlen_one_launch

    def call():
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, backend="math",
                                   strategy="allgather")

    try:
        type(kernel).varlen_one_launch = True
        with dtcp.config.override(timeout_s=20.0, allgather_exchange=r != n - 1):
            t0 = time.monotonic()
            try:
                call()
                raised = ("returned", "")
            except Exception as e:  # noqa: BLE001 - the test inspects what was raised
                raised = (type(e).__name__, str(e))
            seconds = time.monotonic() - t0
        again = call()  # the setting the same everywhere again: the group still works
    finally:
        type(kernel).varlen_one_launch = saved
    return {"raised": raised, "seconds": seconds, "again": tuple(again.shape)}


def test_the_exchange_setting_on_one_rank_only_is_refused_on_every_rank():
    """Every rank raises PeerMismatchError at once, naming dtcp.config.allgather_exchange, before
    any collective (one would never meet the other); the group then works."""
    for r in run_ranks(4, exchange_setting_on_one_rank, timeout=120):
        kind, message = r["raised"]
        assert kind == "PeerMismatchError" and "allgather_exchange" in message, r
        assert r["seconds"] < 5.0, r
        assert r["again"][2] > 0, r


def compiled_exchange(totals=(64, 64, 96, 96, 80, 64)):
    """On each rank: the all-gather over a new `Balanced` document mix every step, the packed length
    changing at the third (`totals`), eager and under torch.compile(fullgraph=True, aot_eager):
    both against single-process attention, each other bit for bit, and the K/V bytes each pass
    sends against its plan's exchange."""
    import random

    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from dtcp.comm import STATS
    from dtcp.exec.route import CallArgs, clear_routes, route_for
    from dtcp.kernels import KERNELS, default_scale

    torch._dynamo.reset()
    counters.clear()
    n = dist.get_world_size()
    kernel = KERNELS["math"]
    saved = type(kernel).varlen_one_launch

    def attend(q, k, v, cu):
        return dtcp.ring_attention(q, k, v, layout="balanced@1", cu_seqlens=cu, is_causal=True, enable_gqa=True,
                                   backend="math", strategy="allgather", return_lse=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    rng = random.Random(11)
    worst, same, sent, frames = 0.0, [], [], []
    try:
        type(kernel).varlen_one_launch = True
        clear_routes()
        for step, total in enumerate(totals):
            docs, left = [], total
            while left:
                docs.append(min(left, rng.choice((1, 2, 3, 5, 9, 17, 33))))
                left -= docs[-1]
            cu_list = [0, *itertools.accumulate(docs)]
            cu = torch.tensor(cu_list, dtype=torch.int32)
            layout = dtcp.Balanced.from_cu_seqlens(cu, min_chunk=1)
            g = torch.Generator().manual_seed(step)
            q, k, v, dout = (torch.randn(1, h, total, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref, lse_ref = reference_attention(*ref, mask=window_doc_mask(total, is_causal=True, cu_seqlens=cu_list))
            out_ref.backward(dout)
            args = CallArgs(dist.group.WORLD.group_name, layout.op_spec(), True, default_scale(8), "math", -1, 0,
                            "allgather")
            results = []
            for fn in (attend, compiled):
                local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
                STATS.reset()
                out, lse = fn(*local, cu)
                out.backward(layout.shard(dout, dim=2))
                plan = route_for(local[0], local[1], local[2], args, tuple(cu_list), "test").plan
                row_bytes = 2 * 2 * 8 * 8  # K and V, 2 heads of 8, float64
                sent.append((STATS.kv_bytes_sent, STATS.grad_bytes_sent, plan.exchange.served_rows * row_bytes,
                             plan.exchange.fetched_rows * row_bytes))
                errors = sharded_errors(layout, (out, lse, *(t.grad for t in local)),
                                        (out_ref, lse_ref.detach(), *(t.grad for t in ref)))
                worst = max(worst, *errors.values())
                results.append([out.detach(), lse.detach()] + [t.grad for t in local])
            same.append(all(torch.equal(a, b) for a, b in zip(*results)))
            frames.append(counter.frame_count)
    finally:
        type(kernel).varlen_one_launch = saved
        clear_routes()
    return {"worst": worst, "same": same, "sent": sent, "frames": frames,
            "graph_breaks": sum(counters["graph_break"].values()), "n": n}


def test_compiled_exchange_with_new_documents_and_lengths():
    """fullgraph, aot_eager, 4 ranks, a new document mix every step (and so a new number of
    boundaries) and packed lengths 64, 64, 96, 96, 80, 64: exact to 1e-10, bit for bit as eager, 0
    graph breaks; the boundaries' new count and the first new length each recompile once, as
    dynamic shapes, and nothing recompiles after (80 and 64 again, more new mixes). Every pass
    sends exactly its plan's rows (K/V twice, the forward's and the custom op backward's, and the
    fetched rows' float64 dK/dV once)."""
    for r in run_ranks(4, compiled_exchange, timeout=300):
        assert r["worst"] < 1e-10, r
        assert all(r["same"]), r
        assert r["graph_breaks"] == 0, r
        assert r["frames"][2] <= 3 and r["frames"][-1] == r["frames"][2], r
        for eager, compiled in zip(r["sent"][::2], r["sent"][1::2]):
            kv, grad, once, want_grad = compiled
            assert (kv, grad) == (2 * once, want_grad), r  # (the custom op's backward exchanges K/V again)
            assert eager[:2] == (once, want_grad), r  # (eager keeps its K/V for the backward)
        assert any(s[2] for s in r["sent"]), r  # some step moved rows


def test_exchange_rows_into_a_buffer_of_the_wrong_shape_is_refused():
    """The forward receives the rows other ranks send straight into its pool's tail
    (exchange_rows(out=)): a buffer of another shape, or not contiguous, is refused before any
    collective is issued."""
    from dtcp.comm.collectives import exchange_rows
    send = torch.zeros(3, 2, 4, 8)
    for out in (torch.zeros(4, 2, 4, 8), torch.zeros(2, 5, 4, 8).transpose(0, 1)):  # (the second: not contiguous)
        with pytest.raises(ValueError, match=r"exchange_rows: out must be contiguous of shape \(5, 2, 4, 8\)"):
            exchange_rows(send, (3, 0), (0, 5), None, "kv", out=out)
