"""The ring with its received blocks in groups (dtcp.config.ring_steps_per_launch = G > 1,
dtcp/plan/group.py and dtcp/exec/grouped.py): a group's launch computes exactly the pairs of its
steps' launches; float64 exactness (out, lse, dq, dk, dv against dense attention, 1e-10) on 2-8
ranks for Balanced, zigzag, striped and contiguous layouts, documents, full attention, GQA,
windows (which run step by step on the same transfers) and batch rows; fewer launches than the
ring; the same K/V bytes in all; compiled with a new document structure every step."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from dtcp.plan import AttnMask, Band, ring_plans
from dtcp.plan.fuse import plan_launches
from dtcp.plan.group import MAX_IN_PLACE_LAUNCHES, InPlaceGroup, group_launches, in_place_group, step_chunks
from sim_ranks import segments_of

KEYS = ("out", "lse", "dq", "dk", "dv")


def _step_pairs(plan, t):
    """(row, key of src's block) pairs of step t's launches."""
    pairs = set()
    for launch in plan_launches(plan)[t]:
        for (qa, qb), (ka, kb) in zip(launch.q_ranges, launch.k_ranges):
            band = Band.from_aligned_window(qb - qa, kb - ka, launch.window)
            pairs |= {(qa + i, ka + j) for i in range(qb - qa) for j in range(kb - ka)
                      if (band.lo is None or j - i >= band.lo) and (band.hi is None or j - i <= band.hi)}
    return pairs


GROUP_PLANS = [  # (layout, documents or None, causal, world size)
    (dtcp.Balanced((40, 3, 3, 2, 9, 7), min_chunk=1), (40, 3, 3, 2, 9, 7), True, 4),
    (dtcp.Balanced((33, 2, 1, 4, 9, 5, 2, 8), min_chunk=1), (33, 2, 1, 4, 9, 5, 2, 8), True, 8),
    (dtcp.Zigzag(), None, True, 4),
    (dtcp.Zigzag(), (7, 20, 5), True, 2),
    (dtcp.Striped(1), (9, 3, 12, 8), True, 4),
    (dtcp.Contiguous(), None, False, 3),
]


def _group_pairs(group) -> list:
    """(row, j, key of step j's direct span) of every pair a group's launches compute, in order."""
    got = []
    if isinstance(group, InPlaceGroup):
        ends = group.offsets[1:] + (group.length,)

        def where(x):  # a buffer row -> (j, key of step j's direct span)
            j = next(j for j, e in enumerate(ends) if x < e)
            return j, x - group.offsets[j]
        for launch in group.launches:
            for (qa, qb), (ka, kb) in zip(launch.q_ranges, launch.k_ranges):
                got += [(row,) + where(x) for row in range(qa, qb) for x in range(ka, kb)]
        return got
    packed = [(j, key) for j, a, e in group.pieces for key in range(a, e)]
    if group.launch is not None:
        assert group.launch.k_ranges[-1][1] == len(packed)
        for (qa, qb), (ka, kb) in zip(group.launch.q_ranges, group.launch.k_ranges):
            got += [(row, j, key) for row in range(qa, qb) for j, key in packed[ka:kb]]
    return got


def _check_in_place(group, plan) -> None:
    """An InPlaceGroup's layout: the steps' direct spans one after another; each launch's keys tile
    one range, the launches' ranges disjoint and, with `zeros`, covering the buffer once; each
    launch's rows disjoint and in order."""
    assert group.offsets == tuple(itertools.accumulate((plan.steps[t].direct_len for t in group.steps[:-1]),
                                                       initial=0))
    assert group.length == sum(plan.steps[t].direct_len for t in group.steps)
    assert len(group.launches) <= MAX_IN_PLACE_LAUNCHES
    cover = list(group.zeros)
    for launch in group.launches:
        assert launch.k_span is not None and launch.q_in_order and launch.window == (-1, -1)
        cover.append(launch.k_span)
    cover.sort()
    assert cover[0][0] == 0 and cover[-1][1] == group.length if cover else group.length == 0
    assert all(a[1] == b[0] for a, b in zip(cover, cover[1:])), cover


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("size", [2, 3, 8])
@pytest.mark.parametrize("layout,docs,causal,n", GROUP_PLANS, ids=str)
def test_a_group_launch_computes_its_steps_pairs_once(layout, docs, causal, n, size, in_place):
    """Expanding a group's launches back to (row, step, key) pairs: each row sees exactly the keys
    its steps' launches give it, each once; the rows of a launch are disjoint. In place, the
    launches read the steps' direct spans one after another (no key twice); packed, a key may be
    packed twice."""
    seq_len = sum(docs) if docs else 48
    mask = AttnMask.make(causal, (-1, 0) if causal else (-1, -1), segments_of(docs) if docs else None)
    kinds = set()
    for plan in ring_plans(layout, seq_len // n, n, causal, mask):
        groups = group_launches(plan, size, in_place=in_place)
        if isinstance(layout, dtcp.Striped):  # its off-diagonal blocks are causal, not full: step by step
            assert groups is None or all(not g.launches for g in groups), plan.rank
            continue
        assert groups is not None, plan.rank  # full off-diagonal launches: one launch a group
        assert tuple(g.steps for g in groups) == step_chunks(len(plan.steps), size)
        for group in groups:
            kinds.add(type(group).__name__)
            want = set()
            for j, t in enumerate(group.steps):
                origin = plan.steps[t].direct_span[0]
                want |= {(row, j, key - origin) for row, key in _step_pairs(plan, t)}
                lo, hi = plan.steps[t].direct_span  # the direct span: the keys the step's tasks use
                assert all(lo <= key < hi for _, key in _step_pairs(plan, t))
            if isinstance(group, InPlaceGroup):
                _check_in_place(group, plan)
            else:
                assert not in_place or in_place_group(plan, group.steps) is None
            for launch in group.launches:
                assert launch.window == (-1, -1)
                rows = sorted(launch.q_ranges)
                assert all(x[1] <= y[0] for x, y in zip(rows, rows[1:]))
            got = _group_pairs(group)
            assert len(got) == len(set(got)) and set(got) == want, (plan.rank, group.steps)
    if not in_place:
        assert kinds <= {"StepGroup"}
    elif isinstance(layout, dtcp.Zigzag) and docs is None:  # causal zigzag: every group in place
        assert kinds == {"InPlaceGroup"}, kinds


def test_direct_spans_pair_up():
    """What a rank sends at step t (its direct home span) is what the rank it sends to receives
    then (that rank's direct span of this rank's block): the same offset on every rank."""
    for layout, docs, causal, n in GROUP_PLANS:
        seq_len = sum(docs) if docs else 48
        mask = AttnMask.make(causal, (-1, 0) if causal else (-1, -1), segments_of(docs) if docs else None)
        plans = ring_plans(layout, seq_len // n, n, causal, mask)
        for plan in plans:
            for t, step in enumerate(plan.steps[1:], start=1):
                peer = plans[(2 * plan.rank - step.src) % n]  # rank + d_t holds this rank's block at step t
                assert peer.steps[t].src == plan.rank
                assert peer.steps[t].direct_span == step.direct_home_span
                assert step.span[0] <= step.direct_span[0] <= step.direct_span[1] <= step.span[1] or \
                    step.direct_len == 0


def test_a_window_has_no_group_launch():
    """A sliding window's off-diagonal launches that are not full (a band) leave their rank step
    by step; a rank whose received blocks are all fully visible still runs them in groups."""
    plans = ring_plans(dtcp.Contiguous(), 16, 4, True, AttnMask.make(True, (20, 0), None))
    banded = [any(launch.window != (-1, -1) for launches in plan_launches(p)[1:] for launch in launches)
              for p in plans]
    assert any(banded)
    for plan, band in zip(plans, banded):
        assert (group_launches(plan, 2) is None) == band, plan.rank


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="ring_steps_per_launch must be an int >= 1"):
        dtcp.config.ring_steps_per_launch = 0
    with pytest.raises(ValueError, match="ring_steps_per_launch"):
        dtcp.config.ring_steps_per_launch = True
    with pytest.raises(ValueError, match='or "auto"'):
        dtcp.config.ring_steps_per_launch = "fast"
    assert dtcp.config.ring_steps_per_launch == 1
    with dtcp.config.override(ring_steps_per_launch="auto"):
        assert dtcp.config.ring_steps_per_launch == "auto"


def test_the_setting_from_the_environment(monkeypatch):
    from dtcp.config import Config
    monkeypatch.setenv("DTCP_RING_STEPS_PER_LAUNCH", "Auto")
    assert Config.from_env().ring_steps_per_launch == "auto"
    monkeypatch.setenv("DTCP_RING_STEPS_PER_LAUNCH", "4")
    assert Config.from_env().ring_steps_per_launch == 4


# ---- on ranks ----------------------------------------------------------------------------------------

def grouped_errors(layout_spec, docs, causal, window, size, heads=(4, 2), batch=1, one_launch=True, in_place=True):
    """ring_attention with the ring in groups of `size` (1: the ring as it is), on this rank:
    errors against dense attention, launches (forward), and the K/V and dK/dV bytes sent."""
    from dtcp.exec import route as route_mod
    from dtcp.kernels.math import MathKernel
    from reference import exact_err, reference_attention, window_doc_mask

    route_mod.clear_routes()
    MathKernel.varlen_one_launch = one_launch  # (this rank process only) the varlen loop stands in for FA4
    calls = {"launches": 0, "inside": 0}
    varlen_fwd, fwd = MathKernel.varlen_forward, MathKernel.forward

    def counting_varlen(self, *a, **k):  # one launch (its loop of dense calls stands in for one)
        calls["launches"] += 1
        calls["inside"] += 1
        try:
            return varlen_fwd(self, *a, **k)
        finally:
            calls["inside"] -= 1

    def counting_dense(self, *a, **k):
        calls["launches"] += not calls["inside"]
        return fwd(self, *a, **k)

    MathKernel.varlen_forward, MathKernel.forward = counting_varlen, counting_dense
    try:
        with dtcp.config.override(ring_steps_per_launch=size, ring_groups_in_place=in_place):
            layout = dtcp.layout_from_spec(layout_spec)
            s = sum(docs) if docs else 16 * dist.get_world_size()
            g = torch.Generator().manual_seed(7)
            q, k, v, dout = (torch.randn(batch, h, s, 8, generator=g, dtype=torch.float64)
                             for h in (heads[0], heads[1], heads[1], heads[0]))
            cu = None
            if docs:
                cu = [0]
                for n in docs:
                    cu.append(cu[-1] + n)
            mask = window_doc_mask(s, is_causal=causal, window=window, cu_seqlens=cu)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref, lse_ref = reference_attention(*ref, mask=mask)
            out_ref.backward(dout)
            local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
            kwargs = {}
            if docs and not isinstance(layout, (dtcp.Balanced, dtcp.DocZigzag)):
                kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
            dtcp.comm_stats.reset()
            out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=causal, window_size=window,
                                           return_lse=True, enable_gqa=heads[0] != heads[1], strategy="ring",
                                           backend="math", **kwargs)
            launches = calls["launches"]
            kv_bytes = dtcp.comm_stats.kv_bytes_sent
            out.backward(layout.shard(dout, dim=2))
            grad_bytes = dtcp.comm_stats.grad_bytes_sent
            from dtcp.comm import state_of
            route = next(iter(route_mod._routes_of(state_of(dist.group.WORLD)).values()))
            got = (out, lse, *(t.grad for t in local))
            want = (out_ref, lse_ref, *(t.grad for t in ref))
            errs = {key: exact_err(a, layout.shard(b, dim=2)) for key, a, b in zip(KEYS, got, want)}
            from dtcp.exec.grouped import _group_indices, grouped
            is_grouped = grouped(route.plan, route.kernel, route.steps_per_launch)
            groups = _group_indices(route.plan, route.kernel, q.device, route.steps_per_launch) if is_grouped else None
            # in groups, each step sends the keys the receiving rank uses (its direct home span)
            sent_keys = sum(s.direct_home_span[1] - s.direct_home_span[0] for s in route.plan.steps[1:])
            return {**errs, "launches": launches, "kv_bytes": kv_bytes, "grad_bytes": grad_bytes,
                    "grouped": is_grouped, "steps": len(route.plan.steps), "size": route.steps_per_launch,
                    "direct_kv_bytes": sent_keys * batch * heads[1] * 2 * 8 * q.element_size(),
                    "in_place": sum(isinstance(g, InPlaceGroup) for g, _ in groups or ())}
    finally:
        MathKernel.varlen_forward, MathKernel.forward = varlen_fwd, fwd
        MathKernel.varlen_one_launch = False
        route_mod.clear_routes()


RANK_CASES = [  # (world size, layout spec, documents, causal, window, group size, heads, batch)
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), True, (-1, -1), 2, (4, 2), 1),
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), True, (-1, -1), 3, (4, 2), 1),
    (8, "balanced@1:33,2,1,4,9,5,2,8", (33, 2, 1, 4, 9, 5, 2, 8), True, (-1, -1), 4, (4, 2), 1),
    (8, "balanced@1:33,2,1,4,9,5,2,8", (33, 2, 1, 4, 9, 5, 2, 8), True, (-1, -1), 7, (4, 4), 1),
    (4, "zigzag", None, True, (-1, -1), 2, (4, 2), 2),
    (4, "zigzag", (9, 3, 12, 8, 16, 16), True, (-1, -1), 3, (4, 1), 1),
    (3, "contiguous", None, False, (-1, -1), 2, (4, 2), 1),
    (4, "striped:1", (9, 3, 12, 8, 32), True, (-1, -1), 2, (4, 2), 1),
    (4, "contiguous", None, True, (20, 0), 2, (4, 2), 1),  # a window: step by step on the grouped transfers
    (2, "zigzag", (7, 20, 5), True, (-1, -1), 2, (4, 2), 1),  # one round: the ring as it is
]


@pytest.mark.parametrize("n,spec,docs,causal,window,size,heads,batch", RANK_CASES, ids=str)
def test_grouped_ring_exact(n, spec, docs, causal, window, size, heads, batch):
    grouped = run_ranks(n, grouped_errors, spec, docs, causal, window, size, heads, batch)
    ring = run_ranks(n, grouped_errors, spec, docs, causal, window, 1, heads, batch)
    for r in grouped:
        for key in KEYS:
            assert r[key] < 1e-10, (key, r)
        assert r["grouped"] == (r["steps"] > 2), r  # two rounds or more: in groups
    # each block goes once to each holder, only the keys it uses: no more K/V bytes than the ring's
    # chains, which carry what every later holder needs (and dK/dV go home the same way)
    for r in grouped:
        if r["grouped"]:
            assert r["kv_bytes"] == r["direct_kv_bytes"], r
    if grouped[0]["grouped"]:  # each received block's share goes home (float64 here, as the keys)
        assert sum(r["grad_bytes"] for r in grouped) == sum(r["kv_bytes"] for r in grouped)
    assert sum(r["kv_bytes"] for r in grouped) <= sum(r["kv_bytes"] for r in ring)
    if spec == "zigzag" and docs is None and grouped[0]["grouped"]:  # a lower rank's block: half of it
        assert sum(r["kv_bytes"] for r in grouped) < sum(r["kv_bytes"] for r in ring)
        assert all(r["in_place"] for r in grouped), grouped
    # fewer launches where the received blocks are fully visible (not striped's causal off-diagonal
    # blocks, nor a window's bands: those run step by step); launches count per batch row
    if grouped[0]["grouped"] and window == (-1, -1) and batch == 1 and not spec.startswith("striped"):
        assert sum(r["launches"] for r in grouped) < sum(r["launches"] for r in ring), (grouped, ring)


@pytest.mark.parametrize("n,spec,docs,size", [(4, "zigzag", None, 3), (8, "balanced@1:33,2,1,4,9,5,2,8",
                                                                  (33, 2, 1, 4, 9, 5, 2, 8), 4)], ids=str)
def test_grouped_ring_packed_and_in_place(n, spec, docs, size):
    """The same call with every group packed (ring_groups_in_place=False) and read in place where
    it can be: both exact (float64, 1e-10), the same bytes on the wire (what travels does not
    depend on how a rank computes on it), in-place groups only where asked for."""
    results = {}
    for in_place in (True, False):
        results[in_place] = run_ranks(n, grouped_errors, spec, docs, True, (-1, -1), size, (4, 2), 1, True, in_place)
        for r in results[in_place]:
            assert r["grouped"] and max(r[key] for key in KEYS) < 1e-10, r
    assert sum(r["in_place"] for r in results[True]) > 0
    assert sum(r["in_place"] for r in results[False]) == 0
    for a, b in zip(results[True], results[False]):
        assert (a["kv_bytes"], a["grad_bytes"]) == (b["kv_bytes"], b["grad_bytes"])


def mixed_in_place_setting(spec, docs, size):
    """Rank 0 packs every group, the others read theirs in place where they can: the transfers
    are the same, so the call is exact on every rank."""
    return grouped_errors(spec, docs, True, (-1, -1), size, in_place=dist.get_rank() != 0)


def test_ranks_may_differ_on_in_place():
    for r in run_ranks(4, mixed_in_place_setting, "zigzag", None, 3):
        assert r["grouped"] and max(r[key] for key in KEYS) < 1e-10, r


AUTO_CASES = [  # (world size, layout spec, documents, grouped)
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), True),  # tiny launches: the model groups them
    (2, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), False),  # one round: nothing to group
]


@pytest.mark.parametrize("n,spec,docs,want_grouped", AUTO_CASES, ids=str)
def test_auto_steps_per_launch(n, spec, docs, want_grouped):
    """ring_steps_per_launch="auto": every rank takes the cost model's size (the same on every
    rank: it is computed over every rank's plan), groups where the model predicts them faster,
    and stays exact (float64, 1e-10)."""
    results = run_ranks(n, grouped_errors, spec, docs, True, (-1, -1), "auto", (4, 2), 1)
    assert len({r["size"] for r in results}) == 1, results
    for r in results:
        assert max(r[key] for key in KEYS) < 1e-10, r
        assert r["grouped"] == want_grouped, r
    if want_grouped:
        assert results[0]["size"] == results[0]["steps"] - 1  # one group of every received block


@contextlib.contextmanager
def counting_grouped_runs():
    """{"grouped": how many ring calls ran in groups} within the block (exec/route.py's
    grouped_forward, counted)."""
    from dtcp.exec import route as route_mod

    runs = {"grouped": 0}
    forward = route_mod.grouped_forward

    def counted(*a, **k):
        runs["grouped"] += 1
        return forward(*a, **k)

    route_mod.grouped_forward = counted
    try:
        yield runs
    finally:
        route_mod.grouped_forward = forward


def per_row_documents_auto(row_cus):
    """test_allgather_varlen.py's per-row document check (each batch row its own documents, zigzag,
    float64 against reference attention) through the ring with ring_steps_per_launch="auto", and
    how many ring calls ran in groups."""
    from test_allgather_varlen import per_row_errors

    with counting_grouped_runs() as runs, dtcp.config.override(ring_steps_per_launch="auto"):
        return {**per_row_errors("zigzag", row_cus, strategy="ring", one_launch=True, local_len=16), **runs}


def test_auto_steps_per_launch_with_documents_per_batch_row():
    """Two batch rows with their own documents (one plan per row, rounds counted per row): every
    rank takes the same size, each row runs in groups, exact to 1e-10."""
    for r in run_ranks(4, per_row_documents_auto, [[0, 20, 40, 64], [0, 10, 50, 64]]):
        assert max(r[key] for key in KEYS) < 1e-10, r
        assert r["grouped"] == 2, r  # one grouped ring call per batch row


def test_grouped_ring_needs_a_one_launch_kernel():
    """With a kernel that makes no one-launch steps (the CPU kernels as they are) the ring runs
    as it is: the setting changes nothing there."""
    for r in run_ranks(4, grouped_errors, "zigzag", None, True, (-1, -1), 2, (4, 2), 1, False):
        assert not r["grouped"] and max(r[k] for k in KEYS) < 1e-10, r


def grouped_compiled(size):
    """tests/test_dynamic_shapes.py's compiled Balanced layer (a new placement every step, two
    packed lengths) with the ring in groups: how many ring calls ran grouped, and its results."""
    from dtcp.exec import route as route_mod
    from dtcp.kernels.cpu_flash import CpuFlashKernel
    from test_dynamic_shapes import balanced_compiled

    CpuFlashKernel.varlen_one_launch = True  # (the kernel "auto" takes on CPU; its varlen loop stands in)
    try:
        with counting_grouped_runs() as runs, dtcp.config.override(ring_steps_per_launch=size):
            return {**balanced_compiled("aot_eager"), **runs}
    finally:
        CpuFlashKernel.varlen_one_launch = False
        route_mod.clear_routes()


def auto_size(seq_len: int, docs, n: int) -> int:
    """ring_steps_per_launch="auto"'s size for grouped_compiled's layer at one of its steps (its
    shapes: heads 4/2 of 4 dims, float64; Balanced(docs, min_chunk=1); the CPU flash kernel with
    its varlen loop standing in for one launch, as grouped_compiled sets it)."""
    from dtcp.exec import route as route_mod
    from dtcp.kernels.cpu_flash import CpuFlashKernel

    plans = ring_plans(dtcp.Balanced(docs, min_chunk=1), seq_len // n, n, True,
                       AttnMask.make(True, (-1, 0), segments_of(docs)))
    q, k = (torch.empty(1, h, seq_len // n, 4, dtype=torch.float64) for h in (4, 2))
    saved, CpuFlashKernel.varlen_one_launch = CpuFlashKernel.varlen_one_launch, True
    try:
        with dtcp.config.override(ring_steps_per_launch="auto"):
            return route_mod.ring_steps(plans, CpuFlashKernel(), q, k, k, n)
    finally:
        CpuFlashKernel.varlen_one_launch = saved


@pytest.mark.parametrize("size", [2, "auto"])
def test_grouped_ring_compiled_with_new_documents_every_step(size):
    """torch.compile(fullgraph=True), aot_eager, 4 ranks: equal to eager (out and every gradient),
    no graph break, no recompile for a new document mix, one for the new packed length. With
    "auto" the size is chosen per call (a new mix is a new route, not a new graph)."""
    from test_dynamic_shapes import BALANCED_STEPS
    first_new_length = next(i for i, (s, _) in enumerate(BALANCED_STEPS) if s != BALANCED_STEPS[0][0])
    # the calls in groups, eager and compiled: every step's at size 2; with "auto", the steps whose
    # plans the cost model groups (computed here from the same plans and shapes)
    want = 2 * (len(BALANCED_STEPS) if size == 2 else sum(auto_size(s, docs, 4) > 1 for s, docs in BALANCED_STEPS))
    assert want > 0
    for r in run_ranks(4, grouped_compiled, size, timeout=400):
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["grouped"] == want, r  # (each ring call once: the compiled and eager calls ran in groups)
        assert r["frames"][:first_new_length] == [1] * first_new_length, r
        assert r["frames"][first_new_length:] == [2] * (len(BALANCED_STEPS) - first_new_length), r


def test_the_cost_model_counts_the_group_launches():
    """strategy="auto"'s launch count (exec/route.py _launches) follows the settings: the local
    step's launches and each group's (one packed, one or two in place), instead of every step's."""
    from dtcp.exec.route import _launches
    from dtcp.kernels import KERNELS

    docs = (33, 2, 1, 4, 9, 5, 2, 8)
    plans = ring_plans(dtcp.Balanced(docs, min_chunk=1), sum(docs) // 8, 8, True,
                       AttnMask.make(True, (-1, 0), segments_of(docs)))
    fa4 = KERNELS["fa4"]
    totals = [0, 0]
    kinds = set()
    for in_place in (True, False):
        with dtcp.config.override(ring_groups_in_place=in_place):
            for plan in plans:
                per_step, rows = _launches(plan, fa4)
                grouped, grouped_rows = _launches(plan, fa4, 4)
                groups = group_launches(plan, 4, in_place=in_place)
                kinds |= {type(g).__name__ for g in groups}
                assert grouped == len(plan_launches(plan)[0]) + sum(len(g.launches) for g in groups), plan.rank
                assert sum(len(g.launches) > 1 for g in groups) == 0 or in_place, plan.rank
                assert grouped <= per_step and grouped_rows <= rows, (plan.rank, grouped, per_step)
                totals[0] += per_step
                totals[1] += grouped
    assert totals[1] < totals[0], totals
    assert kinds == {"InPlaceGroup", "StepGroup"}, kinds


def test_the_cost_model_moves_the_direct_spans_in_groups():
    """In groups each block comes with only the keys its receiver uses: the cost model's keys a
    round (CallShape.ring_kv_len) at size 7 are the widest direct span of each round, averaged,
    where the ring at size 1 moves the chains' spans (what every later holder needs). Fewer on
    packed documents; on causal zigzag each round's widest is a whole block either way."""
    from dtcp.exec.route import _ring_launch_fields
    from dtcp.kernels import KERNELS

    docs, n = (33, 2, 1, 4, 9, 5, 2, 8), 8
    fa4 = KERNELS["fa4"]
    got = {}
    for layout in (dtcp.Balanced(docs, min_chunk=1), dtcp.Zigzag()):
        plans = ring_plans(layout, sum(docs) // n, n, True, AttnMask.make(True, (-1, 0), segments_of(docs)))
        q, k = (torch.empty(1, h, sum(docs) // n, 8) for h in (4, 2))
        ring = _ring_launch_fields(plans, fa4, 1, q, k, k)["ring_kv_len"]
        groups = _ring_launch_fields(plans, fa4, 7, q, k, k)["ring_kv_len"]
        rounds = range(1, plans[0].num_rounds + 1)
        assert ring == sum(max(p.steps[t].span_len for p in plans) for t in rounds) / len(rounds)
        assert groups == sum(max(p.steps[t].direct_len for p in plans) for t in rounds) / len(rounds)
        got[type(layout).__name__] = (groups, ring)
    assert all(groups < ring for groups, ring in got.values()), got
    plans = ring_plans(dtcp.Zigzag(), 64, n, True, AttnMask.make(True))
    q, k = (torch.empty(1, h, 64, 8) for h in (4, 2))
    assert _ring_launch_fields(plans, fa4, 7, q, k, k)["ring_kv_len"] == 64 == \
        _ring_launch_fields(plans, fa4, 1, q, k, k)["ring_kv_len"]


def settings_that_differ():
    """Rank 0 asks for groups, the others not: every rank raises at once, naming the setting."""
    import time
    from dtcp.exec import route as route_mod

    route_mod.clear_routes()
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    start = time.perf_counter()
    try:
        with dtcp.config.override(ring_steps_per_launch=2 if dist.get_rank() == 0 else 1):
            dtcp.ring_attention(q, q.clone(), q.clone(), is_causal=True, strategy="ring")
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}
    finally:
        route_mod.clear_routes()
    return {"error": None}


def test_ranks_that_differ_on_the_setting_raise():
    for r in run_ranks(4, settings_that_differ):
        assert r["error"] is not None and "ring_steps_per_launch" in r["error"], r
        assert r["seconds"] < 10, r


def machines_that_differ(setting: str = "cost_machine"):
    """ring_steps_per_launch="auto" with the cost model's constants set on rank 0 only (a machine
    whose launches cost nothing, where groups gain nothing), or its objective (the device's time
    alone: no launch costs the host anything): rank 0 would run step by step and the others in
    groups. Every rank raises at once, naming what differs."""
    import dataclasses
    import time
    from dtcp.exec import route as route_mod
    from dtcp.kernels.math import MathKernel
    from dtcp.plan import MACHINES

    route_mod.clear_routes()
    MathKernel.varlen_one_launch = True
    docs = (40, 3, 3, 2, 9, 7)
    layout = dtcp.Balanced(docs, min_chunk=1)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(1, 4, sum(docs), 8, generator=g, dtype=torch.float64)
    q = layout.shard(full, dim=2)
    free = dataclasses.replace(MACHINES["h200-nvlink"], launch_s=0.0, call_overhead_s=0.0, ring_launch_host_s=0.0,
                               launch_host_s=())
    start = time.perf_counter()
    try:
        rank0 = {"cost_machine": free, "cost_objective": "device"}[setting]
        others = {"cost_machine": None, "cost_objective": "call"}[setting]
        with dtcp.config.override(ring_steps_per_launch="auto", **{setting: rank0 if dist.get_rank() == 0 else others}):
            dtcp.ring_attention(q, q.clone(), q.clone(), layout=layout, is_causal=True, strategy="ring", backend="math")
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}
    finally:
        MathKernel.varlen_one_launch = False
        route_mod.clear_routes()
    return {"error": None}


@pytest.mark.parametrize("setting", ["cost_machine", "cost_objective"])
def test_ranks_whose_cost_constants_differ_raise(setting):
    for r in run_ranks(4, machines_that_differ, setting):
        assert r["error"] is not None and "ring steps per launch" in r["error"], r
        assert setting in r["error"] and r["seconds"] < 10, r


# ---- one rank fails inside a group ---------------------------------------------------------------------

def one_rank_fails_in_a_group(failing_rank: int, at: int, side: str):
    """ring_attention in groups of 2 on 4 ranks (zigzag: the local step runs its tasks, each
    group one varlen launch) whose kernel raises on one rank at its `at`-th group launch, forward
    or backward: that rank raises its error; every other rank raises a peer error within the
    timeout, in that call or, where it had already received all it needed from the failed rank
    (its transfers are direct, not a chain through every rank: its results are whole), in its
    next call."""
    from dtcp.kernels import KERNELS
    from dtcp.kernels.math import MathKernel
    from test_failures import T, _outcome, _world_healthy

    class FailsInAGroup(MathKernel):
        name = "test_failing"
        varlen_one_launch = True  # (its varlen loop stands in for one launch: the ring runs in groups)
        launches = 0

        def _maybe_fail(self, what):
            if what == side:
                self.launches += 1
                if dist.get_rank() == failing_rank and self.launches == at:
                    raise RuntimeError("CUDA out of memory (injected by the test)")

        def varlen_forward(self, *a, **k):
            self._maybe_fail("fwd")
            return super().varlen_forward(*a, **k)

        def varlen_backward(self, *a, **k):
            self._maybe_fail("bwd")
            return super().varlen_backward(*a, **k)

    n = dist.get_world_size()
    kernel = KERNELS["test_failing"] = FailsInAGroup()
    try:
        with dtcp.config.override(timeout_s=T, ring_steps_per_launch=2):
            g = dist.new_group(list(range(n)))
            gen = torch.Generator().manual_seed(dist.get_rank())

            def call():
                q, k, v = (torch.randn(1, h, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True)
                           for h in (4, 2, 2))
                out = dtcp.ring_attention(q, k, v, g, layout="zigzag", is_causal=True, enable_gqa=True,
                                          strategy="ring", backend="test_failing")
                out.sum().backward()

            first, second = _outcome(call), _outcome(call)
        return {"first": first, "second": second, "world": _world_healthy(), "launches": kernel.launches}
    finally:
        del KERNELS["test_failing"]


@pytest.mark.parametrize("failing_rank,at,side", [(2, 1, "fwd"), (1, 2, "fwd"), (3, 1, "bwd"), (0, 2, "bwd")])
def test_one_rank_fails_in_a_group(failing_rank, at, side):
    from test_failures import T
    results = run_ranks(4, one_rank_fails_in_a_group, failing_rank, at, side, timeout=120)
    for rank, r in enumerate(results):
        kind, message, seconds = r["first"]
        peer_errors = ("PeerFailedError", "PeerTimeoutError")
        if rank == failing_rank:
            assert kind == "RuntimeError" and "injected" in message and r["launches"] == at, (rank, r)
            assert r["second"][0] == "GroupFailedError" and r["second"][2] < 1.0, (rank, r)
        elif kind == "returned":  # done before the failure reached it: the next call raises
            assert r["second"][0] in peer_errors + ("GroupFailedError",) and r["second"][2] < 3 * T, (rank, r)
        else:
            assert kind in peer_errors, (rank, r)
            assert r["second"][0] == "GroupFailedError" and r["second"][2] < 1.0, (rank, r)
        assert seconds < 3 * T, (rank, r)
        assert r["world"], (rank, r)
    assert sum(r["first"][0] != "returned" for r in results) >= 2, results  # the failure and a peer of it


def test_group_launches_follow_the_gaps_setting(monkeypatch):
    """The executor's cached group launches are keyed on whether the kernel reads rows lying apart
    in place (dtcp.config.varlen_gaps can change between calls): each setting gets its own."""
    from dtcp.exec.grouped import _group_indices
    from dtcp.kernels.math import MathKernel

    monkeypatch.setattr(MathKernel, "varlen_gaps", True)
    docs = (33, 2, 1, 4, 9, 5, 2, 8)
    plan = ring_plans(dtcp.Balanced(docs, min_chunk=1), sum(docs) // 8, 8, True,
                      AttnMask.make(True, (-1, 0), segments_of(docs)))[0]
    kernel = MathKernel()
    with dtcp.config.override(varlen_gaps=True):
        on = _group_indices(plan, kernel, torch.device("cpu"), 2)
    with dtcp.config.override(varlen_gaps=False):
        off = _group_indices(plan, kernel, torch.device("cpu"), 2)
    assert on is not None and off is not None and on is not off
    assert all(not li.q.gapped and not li.k.gapped for _, lis in off for li in lis)
    with dtcp.config.override(varlen_gaps=True, ring_groups_in_place=False):  # ... and on the in-place setting
        packed = _group_indices(plan, kernel, torch.device("cpu"), 2)
    assert packed is not on and {type(g).__name__ for g, _ in packed} == {"StepGroup"}
    assert "InPlaceGroup" in {type(g).__name__ for g, _ in on}


@pytest.mark.parametrize("layout,docs,causal,n", GROUP_PLANS, ids=str)
def test_share_writes_give_the_summed_shares(layout, docs, causal, n):
    """Each step's share built by share_writes (the first piece on a key copied, later ones
    added, the keys no piece holds zeroed) equals a zero fill plus every piece's add, exactly
    (integers), on every group of every rank; duplicates (a key packed twice) do occur."""
    from dtcp.plan.group import share_writes

    s = sum(docs) if docs else 16 * n
    mask = AttnMask.make(causal, (-1, 0) if causal else (-1, -1), segments_of(docs) if docs else None)
    adds = 0
    for size in (2, 3, 8):
        for plan in ring_plans(layout, s // n, n, causal, mask):
            for group in group_launches(plan, size, in_place=False) or ():
                if group.launch is None:
                    continue
                span_lens = tuple(plan.steps[t].direct_len for t in group.steps)
                packed = torch.arange(1, group.packed_len + 1, dtype=torch.int64) * 1000
                for j, (writes, zeros) in enumerate(share_writes(group, span_lens)):
                    want = torch.zeros(span_lens[j], dtype=torch.int64)
                    off = 0
                    for jj, a, e in group.pieces:
                        if jj == j:
                            want[a:e] += packed[off:off + e - a]
                        off += e - a
                    got = torch.full((span_lens[j],), -7, dtype=torch.int64)  # (garbage: an empty buffer)
                    for first, a, e, o in writes:
                        if first:
                            got[a:e] = packed[o:o + e - a]
                        else:
                            got[a:e] += packed[o:o + e - a]
                            adds += 1
                    for a, e in zeros:
                        got[a:e] = 0
                    assert torch.equal(got, want), (plan.rank, size, j, group)
    if n >= 4 and isinstance(layout, (dtcp.Balanced, dtcp.Zigzag)):
        assert adds > 0  # two chunks of a rank see the same earlier keys: packed twice


GROUPED_DIRECT_CASES = [  # (world size, layout spec, documents, group size, heads, batch, gaps)
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), 2, (4, 2), 2, False),
    (8, "balanced@1:33,2,1,4,9,5,2,8", (33, 2, 1, 4, 9, 5, 2, 8), 7, (4, 2), 1, True),
    (4, "zigzag", (9, 3, 12, 8), 3, (4, 2), 1, False),
]


@pytest.mark.parametrize("n,spec,docs,size,heads,batch,gaps", GROUPED_DIRECT_CASES, ids=str)
def test_grouped_first_launch_writes_the_results_directly(n, spec, docs, size, heads, batch, gaps):
    """In groups too, the local step's first launch writes the results and float32 holds only the
    hulls (the shares that come home included): bf16 results bitwise equal to float32 over every
    row and key (a hull that misses a later launch or a returned share loses it: not equal)."""
    from test_ring_one_launch import direct_write_results
    results = run_ranks(n, direct_write_results, spec, docs, (-1, -1), heads, batch, gaps, size)
    for r in results:
        assert r["grouped"] and all(r["bitwise"]), r
        assert r["dtypes"][0] == "torch.bfloat16" and r["dtypes"][1] == "torch.float32", r
    assert any(r["direct"] for r in results), results


def _landings_built(spec, docs, size, calls):
    """ring_attention in groups of `size`, `calls` times with the same documents (bf16, the math
    kernel taking one-launch steps with gaps): how many Landings (row_runs) were built, and whether
    this rank's pass wrote its results directly (it then lands its group launches by role)."""
    import dtcp.exec.fused as fused_mod
    from dtcp.kernels.math import MathKernel
    built = []
    row_runs = fused_mod.row_runs
    fused_mod.row_runs = lambda *a: built.append(1) or row_runs(*a)
    dtcp.exec.route.clear_routes()
    MathKernel.varlen_one_launch = MathKernel.varlen_gaps = True
    try:
        layout = dtcp.layout_from_spec(spec)
        g = torch.Generator().manual_seed(3)
        full = [torch.randn(1, h, sum(docs), 16, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4)]
        with dtcp.config.override(ring_steps_per_launch=size):
            for _ in range(calls):
                local = [layout.shard(t, dim=2).detach().requires_grad_() for t in full[:3]]
                out = dtcp.ring_attention(*local, layout=layout, is_causal=True, enable_gqa=True, strategy="ring",
                                          backend="math")
                out.backward(layout.shard(full[3], dim=2))
        from test_ring_one_launch import _the_route
        route = _the_route()
        fused = fused_mod.fused_steps(route.plan, route.kernel, torch.device("cpu"))
        direct = fused is not None and fused_mod.fills_rows(fused[0], sum(docs) // dist.get_world_size())
        return {"built": len(built), "direct": direct}
    finally:
        fused_mod.row_runs = row_runs
        MathKernel.varlen_one_launch = MathKernel.varlen_gaps = False
        dtcp.exec.route.clear_routes()


def test_grouped_ring_builds_its_landing_once_per_plan():
    """The grouped ring's Landing (which rows each group launch lands where, and their roles on
    the device) is built once per plan, not per call and pass: the grouped ring builds the tuple
    of its launch sites anew every call, and a Landing keyed by that tuple was built again at every
    call, forward and backward, copying its roles to the device each time (a copy from host
    memory that waits for the GPU: on one H100 78 ms of host a forward where the work took 8).
    Three calls, forward and backward: one build on a rank whose pass writes directly."""
    results = run_ranks(4, _landings_built, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), 2, 3)
    assert any(r["direct"] for r in results), results
    for r in results:
        assert r["built"] == (1 if r["direct"] else 0), results


@pytest.mark.parametrize("layout,docs", [(dtcp.Zigzag(), None), (dtcp.Balanced((33, 2, 1, 4, 9, 5, 2, 8), min_chunk=1),
                                                                 (33, 2, 1, 4, 9, 5, 2, 8))], ids=str)
def test_no_comm_groups_compute_what_the_ring_does(layout, docs, monkeypatch):
    """With NoComm (the benchmarks' stand-in: every block is the rank's own), the ring in groups
    of 3 computes out, lse and dQ as the ring does step by step (float64): its in-place groups
    read the buffer NoComm keeps (`NoComm.stand_in`), made on the first pass and reused by the
    next; a new plan gets its own."""
    from dtcp.comm.p2p import NoComm
    from dtcp.exec.grouped import _group_indices, grouped_backward, grouped_forward
    from dtcp.exec.ring import ring_backward, ring_forward
    from dtcp.kernels.math import MathKernel

    monkeypatch.setattr(MathKernel, "varlen_one_launch", True)
    n = 8
    s = sum(docs) if docs else 64
    mask = AttnMask.make(True, (-1, 0), segments_of(docs) if docs else None)
    kernel = MathKernel()
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 4, s // n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, s // n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    in_place = 0
    for plan in ring_plans(layout, s // n, n, True, mask):
        comm = NoComm()
        want_out, want_lse = ring_forward(q, k, v, plan, kernel, 0.3, NoComm())
        want_dq = ring_backward(dout, q, k, v, want_out, want_lse, plan, kernel, 0.3, NoComm())[0]
        for _ in range(2):
            out, lse = grouped_forward(q, k, v, plan, kernel, 0.3, comm, size=3)
            dq = grouped_backward(dout, q, k, v, out, lse, plan, kernel, 0.3, comm, size=3)[0]
            for got, want in ((out, want_out), (lse, want_lse), (dq, want_dq)):
                assert (got - want).abs().max() <= 1e-12 * want.abs().max(), plan.rank
        groups = _group_indices(plan, kernel, q.device, 3)
        made = sum(isinstance(g, InPlaceGroup) for g, _ in groups)
        assert len(comm._stand_ins) == 2 * made, plan.rank  # (K and V of each in-place group, made once)
        in_place += made
    assert in_place > 0
