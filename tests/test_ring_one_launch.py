"""One launch per ring step: a step's tasks as varlen calls (dtcp/plan/fuse.py, dtcp/exec/fused.py).

Pure Python: the launches of every step compute exactly the (query, key) pairs of its tasks,
each pair once, with rows disjoint inside a launch, and causal document steps take at most two
launches. On ranks: with a kernel that takes a step in one varlen call (the math kernel's varlen
loop stands in on CPU for FA4 and flash, which take it in one launch), out, lse, dq, dk and dv
are exact in float64 for documents, windows, striped and balanced layouts on 2-8 ranks, and the
calls per step are counted."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from dtcp.plan import AttnMask, Band, ring_plans
from dtcp.plan.fuse import merge_rows, step_launches
from sim_ranks import segments_of
from reference import exact_err, reference_attention, window_doc_mask

KEYS = ("out", "lse", "dq", "dk", "dv")


def _pairs_of_tasks(tasks):
    return sorted((t.q_start + i, t.k_start + j) for t in tasks for i in range(t.q_len) for j in range(t.k_len)
                  if t.visible(i, j))


def _pairs_of_launches(launches):
    pairs = []
    for launch in launches:
        for (qa, qb), (ka, kb) in zip(launch.q_ranges, launch.k_ranges):
            band = Band.from_aligned_window(qb - qa, kb - ka, launch.window)
            pairs += [(qa + i, ka + j) for i in range(qb - qa) for j in range(kb - ka)
                      if (band.lo is None or j - i >= band.lo) and (band.hi is None or j - i <= band.hi)]
    return sorted(pairs)



PLANS = [  # (layout, documents or None, window, world size)
    (dtcp.Zigzag(), (7, 20, 5), (-1, -1), 2),
    (dtcp.Zigzag(), None, (-1, -1), 4),
    (dtcp.Striped(1), (9, 3, 12, 8), (-1, -1), 4),
    (dtcp.Striped(2), None, (5, 0), 2),
    (dtcp.Contiguous(), (30, 2, 16), (6, 0), 3),
    (dtcp.Balanced((40, 3, 3, 2, 9, 7), min_chunk=1), (40, 3, 3, 2, 9, 7), (-1, -1), 4),
    (dtcp.Balanced((5, 1, 30, 12), min_chunk=1), (5, 1, 30, 12), (4, 0), 3),
    (dtcp.DocZigzag((5, 3, 9)), None, (-1, -1), 2),
]


@pytest.mark.parametrize("layout,docs,window,n", PLANS, ids=str)
def test_launches_compute_each_pair_of_the_tasks_once(layout, docs, window, n):
    if isinstance(layout, dtcp.DocZigzag):
        seq_len, segments = layout.padded_len(n), layout.segments(n)
    else:
        seq_len, segments = sum(docs) if docs else 48, (segments_of(docs) if docs else None)
    mask = AttnMask.make(True, window, segments)
    for plan in ring_plans(layout, seq_len // n, n, True, mask):
        for step in plan.steps:
            launches = step_launches(step.tasks)
            assert _pairs_of_launches(launches) == _pairs_of_tasks(step.tasks), (plan.rank, step)
            for launch in launches:
                rows = sorted(launch.q_ranges)
                assert all(a[1] <= b[0] for a, b in zip(rows, rows[1:]))  # disjoint rows inside a launch
                assert min(launch.window) >= -1
            if window == (-1, -1) and segments is not None and not isinstance(layout, dtcp.Striped):
                assert len(launches) <= 2, (plan.rank, [l.window for l in launches])


def test_a_full_block_and_the_diagonal_merge_into_one_bottom_right_causal_sequence():
    from dtcp.plan import Task
    full, diag = Task(4, 8, 0, 4), Task(4, 8, 4, 8, None, 0)
    (merged,) = merge_rows([full, diag])
    assert (merged.q_start, merged.q_end, merged.k_start, merged.k_end) == (4, 8, 0, 8)
    assert merged.is_bottom_right_causal
    # a left window edge that leaves the last row without a's last key would open a gap: no merge
    assert len(merge_rows([Task(4, 8, 0, 4, 2, None), Task(4, 8, 4, 8, None, 0)])) == 2
    # one that still reaches it merges (row 3 sees keys 4..7 of the joined block, row 0 keys 1..4)
    (joined,) = merge_rows([Task(4, 8, 0, 4, 1, None), Task(4, 8, 4, 8, None, 0)])
    assert (joined.lo, joined.hi) == (1, 4)


def test_a_one_row_document_piece_joins_the_causal_launch():
    """A document's first token alone at a rank's end is a 1x1 block: full and causal at once. It
    joins the causal launch (one launch whose rows tile the shard: views, no gathers) instead of
    a launch of its own that leaves the causal one with a gap (measured: 0.46 of one GPU)."""
    from dtcp.plan import Task
    launches = step_launches([Task(0, 7, 0, 7, None, 0), Task(7, 8, 7, 8), Task(8, 12, 8, 12, None, 0)])
    assert len(launches) == 1 and launches[0].window == (-1, 0) and launches[0].q_span == (0, 12)
    # a one-row piece that sees a whole earlier block joins too (row 0 of 1 sees every key)
    launches = step_launches([Task(0, 6, 0, 6, None, 0), Task(6, 7, 0, 5)])
    assert len(launches) == 1 and launches[0].window == (-1, 0), launches
    # two rows that see a whole block are not causal: a launch of their own
    assert len(step_launches([Task(0, 6, 0, 6, None, 0), Task(6, 8, 0, 5)])) == 2
    # on a plan: contiguous, documents 7 and 9 over 2 ranks (rank 0 holds the 9's first token)
    mask = AttnMask.make(True, (-1, -1), segments_of((7, 9)))
    plan = ring_plans(dtcp.Contiguous(), 8, 2, True, mask)[0]
    (diagonal,) = step_launches(plan.steps[0].tasks)
    assert diagonal.q_span == (0, 8) and diagonal.k_span == (0, 8)


def test_stacked_tasks_over_the_same_first_key_merge_exactly():
    """merge_stacked on random pairs: when it joins, the joined task computes exactly the pairs of
    both; a cut document's two chunks side by side (causal over the first, bottom-right causal
    over both) are one causal sequence."""
    from dtcp.plan import Task
    from dtcp.plan.fuse import merge_stacked
    (joined,) = merge_rows([Task(10, 14, 10, 14, None, 0), Task(14, 20, 10, 20, None, 4)])
    assert (joined.q_start, joined.q_end, joined.k_start, joined.k_end) == (10, 20, 10, 20) and joined.is_square_causal
    # a row of the lower block that sees a key the upper block's rows cannot reach: no merge
    assert merge_stacked(Task(0, 4, 0, 4, None, 0), Task(4, 6, 0, 8)) is None
    rng = random.Random(5)
    bound = lambda: rng.choice([None, rng.randint(-6, 6)])  # noqa: E731
    joins = 0
    for _ in range(8000):
        qa, qb, ka, kb = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 7), rng.randint(0, 5)
        a = Task(0, qa, 0, ka, bound(), bound())
        b = Task(qa, qa + qb, 0, ka + kb, bound(), bound())
        if not _pairs_of_tasks([a]) or not _pairs_of_tasks([b]):
            continue
        m = merge_stacked(a, b)
        if m is not None:
            joins += 1
            assert _pairs_of_tasks([m]) == _pairs_of_tasks([a, b]), (a, b, m)
            assert min(m.band.aligned_window(m.q_len, m.k_len)) >= -1
    assert joins > 100


def test_balanced_local_step_takes_the_keys_as_one_view():
    """Balanced over long-tailed documents: every rank's local step is one launch whose rows and
    keys both tile the shard (a cut document's chunks held side by side join), so the launch
    gathers nothing; before the stacked merge its keys came in one range per document."""
    docs = (700, 90, 33, 2000, 64, 5, 300, 1200, 17, 640, 77, 3000, 81, 1)
    docs = docs[:-1] + (docs[-1] + (-sum(docs)) % 8,)
    n = 4
    mask = AttnMask.make(True, (-1, -1), segments_of(docs))
    cut = 0
    for plan in ring_plans(dtcp.Balanced(docs, min_chunk=64), sum(docs) // n, n, True, mask):
        (local,) = step_launches(plan.steps[0].tasks)
        assert local.q_span == (0, sum(docs) // n) and local.k_span == local.q_span, (plan.rank, local)
        cut += len(plan.steps[0].tasks) - len(local.q_ranges)
    assert cut > 0  # some documents were cut and their chunks joined


def test_random_tasks_of_random_plans_fuse_exactly():
    rng = random.Random(3)
    for _ in range(40):
        n = rng.choice([2, 3, 4])
        docs = tuple(rng.randint(1, 20) for _ in range(rng.randint(1, 6)))
        total = sum(docs) + (-sum(docs)) % (2 * n)
        docs = docs[:-1] + (docs[-1] + total - sum(docs),)
        layout = rng.choice([dtcp.Zigzag(), dtcp.Contiguous(), dtcp.Striped(1), dtcp.Balanced(docs, min_chunk=1)])
        window = rng.choice([(-1, -1), (rng.randint(0, 12), 0), (rng.randint(0, 6), rng.randint(0, 6))])
        causal = window[1] <= 0 and rng.random() < 0.7
        mask = AttnMask.make(causal, window, segments_of(docs))
        for plan in ring_plans(layout, total // n, n, causal, mask):
            for step in plan.steps:
                assert _pairs_of_launches(step_launches(step.tasks)) == _pairs_of_tasks(step.tasks)


# ---- on ranks ----------------------------------------------------------------------------------------

def _the_route():
    """The one route this rank built since clear_routes() (its ring_attention calls share it)."""
    from dtcp.exec.route import _routes_of
    from dtcp.comm import state_of
    return next(iter(_routes_of(state_of(dist.group.WORLD)).values()))


def one_launch_errors(layout_spec, docs, window, heads=(4, 2), d=8, batch=1, gaps=False, slots=True):
    """... with `slots`: later launches kept whole and merged (summed) once at the end where a
    pass's first launch writes the results (exec/fused.py Slots), else launch by launch; "odd":
    on the odd ranks only (a setting that differs between ranks changes nothing another rank sees)."""
    import dtcp.exec.ring as ring_mod
    from dtcp.kernels.math import MathKernel
    dtcp.exec.route.clear_routes()  # (pooled rank processes: the route read below must be this call's)
    n = dist.get_world_size()
    MathKernel.varlen_one_launch = True  # (this rank process only) the varlen loop stands in for one launch
    # ... and, with `gaps`, for FA4's seqused (rows and keys that lie apart read in place)
    MathKernel.varlen_gaps = gaps
    calls = {"launches": 0, "tasks": 0}
    varlen_fwd, fwd = MathKernel.varlen_forward, MathKernel.forward

    def counting_varlen(self, *a, **k):
        calls["launches"] += 1
        return varlen_fwd(self, *a, **k)

    MathKernel.varlen_forward = counting_varlen
    kept = {"merged": 0, "summed": 0}
    merge_slots, sum_slots = ring_mod.merge_slots_, ring_mod.sum_slots_

    def counting_merge(*a, **k):
        kept["merged"] += 1
        return merge_slots(*a, **k)

    def counting_sum(*a, **k):
        kept["summed"] += 1
        return sum_slots(*a, **k)

    ring_mod.merge_slots_, ring_mod.sum_slots_ = counting_merge, counting_sum
    keep = slots is True or (slots == "odd" and dist.get_rank() % 2 == 1)
    setting = dtcp.config.override(merge_slots_bytes=dtcp.config.merge_slots_bytes if keep else 0)
    setting.__enter__()
    try:
        layout = dtcp.layout_from_spec(layout_spec)
        s = sum(docs)
        g = torch.Generator().manual_seed(11)
        q, k, v, dout = (torch.randn(batch, h, s, d, generator=g, dtype=torch.float64)
                         for h in (heads[0], heads[1], heads[1], heads[0]))
        cu = torch.tensor(_cumulative(docs), dtype=torch.int32)
        mask = window_doc_mask(s, is_causal=True, window=window, cu_seqlens=cu.tolist())
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        out_ref, lse_ref = reference_attention(*ref, mask=mask)
        out_ref.backward(dout)
        local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
        kwargs = {} if isinstance(layout, (dtcp.Balanced, dtcp.DocZigzag)) else {"cu_seqlens": cu}
        out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=True, window_size=window, return_lse=True,
                                       enable_gqa=True, strategy="ring", backend="math", **kwargs)
        out.backward(layout.shard(dout, dim=2))
        route = _the_route()
        steps = route.plan.num_rounds + 1
        got = (out, lse, *(t.grad for t in local))
        want = (out_ref, lse_ref, *(t.grad for t in ref))
        errs = {key: exact_err(a, layout.shard(b, dim=2)) for key, a, b in zip(KEYS, got, want)}
        from dtcp.exec.fused import fused_steps
        fused = fused_steps(route.plan, route.kernel, q.device)
        gapped = sum(li.q.gapped or li.k.gapped for step in fused or () for li in step)
        later = [li for step in fused or () for li in step][1:]
        from dtcp.exec.fused import MAX_SLOT_SPANS, fills_rows
        # later launches whose query rows lie apart, in a pass whose first launch writes the results
        # and whose later rows are few enough ranges to keep (exec/fused.py slots_of)
        gapped_kept = sum(li.q.gapped for li in later) if fused is not None and \
            fills_rows(fused[0], s // n) and all(li.q.span is not None for li in later) and \
            sum(len(li.q.ranges) for li in later) <= MAX_SLOT_SPANS else 0
        most_ranges = max((len(w.ranges) for step in fused or () for li in step for w in (li.q, li.k) if w.gapped),
                          default=0)
        return {**errs, "launches": calls["launches"], "steps": steps, "tasks": len(route.plan.tasks),
                "fused": fused is not None, "gapped": gapped, "most_gapped_ranges": most_ranges, "keep": keep,
                "gapped_kept": gapped_kept, **kept}
    finally:
        setting.__exit__(None, None, None)
        ring_mod.merge_slots_, ring_mod.sum_slots_ = merge_slots, sum_slots
        MathKernel.varlen_forward, MathKernel.varlen_one_launch = varlen_fwd, False
        MathKernel.varlen_gaps = False
        dtcp.exec.route.clear_routes()


def _cumulative(docs):
    out = [0]
    for n in docs:
        out.append(out[-1] + n)
    return out


RANK_CASES = [  # (world size, layout spec, documents, window)
    (2, "zigzag", (7, 20, 5), (-1, -1)),
    (4, "zigzag", (9, 3, 12, 8), (-1, -1)),
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), (-1, -1)),
    (3, "balanced@1:5,1,30,12", (5, 1, 30, 12), (4, 0)),
    (2, "striped:2", (10, 6, 16), (-1, -1)),
    (3, "contiguous", (20, 2, 14), (5, 0)),
    (8, "balanced@1:33,2,1,4,9,5,2,8", (33, 2, 1, 4, 9, 5, 2, 8), (-1, -1)),
    # many sequences a launch, rows and keys apart in order: gapped launches of a dozen ranges
    (4, "doczigzag:16,8,24,8,40,8,16", (16, 8, 24, 8, 40, 8, 16), (-1, -1)),
]


@pytest.mark.parametrize("slots", [True, False, "odd"], ids=["slots", "launch_by_launch", "odd_ranks_slots"])
@pytest.mark.parametrize("gaps", [False, True], ids=["gather", "gaps"])
@pytest.mark.parametrize("n,spec,docs,window", RANK_CASES, ids=str)
def test_one_launch_per_step_exact(n, spec, docs, window, gaps, slots):
    """Exact in float64 with launches that gather rows and keys lying apart, and with launches
    that read them in place between gaps (FA4's seqused; the math kernel's varlen loop stands in);
    the later launches' outputs and dQ kept whole and merged once at the end (`slots`), or merged
    and added launch by launch."""
    results = run_ranks(n, one_launch_errors, spec, docs, window, gaps=gaps, slots=slots)
    # kept: the forward merges and the backward sums once a pass, on the same ranks
    assert all(r["merged"] == r["summed"] <= (1 if r["keep"] else 0) for r in results), results
    if slots in (True, "odd") and spec in ("zigzag", "contiguous"):  # (every later launch's rows one range)
        assert sum(r["merged"] for r in results) > 0, results
    if not gaps:
        assert all(r["gapped"] == 0 for r in results)
    elif spec.startswith(("balanced@1:40", "balanced@1:33", "doczigzag")):
        assert sum(r["gapped"] for r in results) > 0  # the gapped path ran
    if gaps and spec.startswith("doczigzag"):  # ... with many ranges in one window (one masked merge)
        assert max(r["most_gapped_ranges"] for r in results) >= 5, results
    # later launches whose rows lie apart are kept whole too (their windows), merged once a pass
    for r in results:
        if r["keep"] and r["gapped_kept"]:
            assert r["merged"] == r["summed"] == 1, r
    if gaps and slots is True and spec.startswith(("balanced@1:40", "balanced@1:33", "doczigzag")):
        assert sum(r["gapped_kept"] for r in results) > 0, results
    for r in results:
        for key in KEYS:
            assert r[key] < 1e-10, (key, r)
        if window == (-1, -1) and not spec.startswith("striped"):
            assert r["launches"] <= 2 * r["steps"], r  # at most two launches per step, forward
        # where fusing saves a launch the step launches ran (fewer than the tasks), else the tasks did
        assert (0 < r["launches"] < r["tasks"]) if r["fused"] else r["launches"] == 0, r
    assert any(r["fused"] for r in results)


def _random_balanced_case(seed: int):
    """A random packed batch for Balanced: a world size, documents of every kind (empty, one
    token, short, long: their sum a multiple of N), a minimum chunk small enough to cut, and a
    window or none."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4, 8])
    docs = [rng.choice([0, 1, 2, rng.randint(3, 12), rng.randint(13, 60)]) for _ in range(rng.randint(3, 12))]
    docs.append(-sum(docs) % n + n)  # (the total a multiple of N, and at least N more tokens)
    min_chunk = rng.choice([1, 2, 4])
    window = rng.choice([(-1, -1), (-1, -1), (rng.randint(1, 20), 0)])
    spec = f"balanced@{min_chunk}:" + ",".join(map(str, docs)) if min_chunk != 512 else None
    return n, spec, tuple(docs), window


@pytest.mark.parametrize("seed", range(6))
def test_random_balanced_batches_one_launch_exact(seed):
    """Random Balanced batches (tests/test_ring_one_launch.py _random_balanced_case) with one-launch
    steps that read rows and keys lying apart in place (FA4's seqused; the math kernel's loop
    stands in), later launches kept whole and merged once a pass: out, lse, dq, dk, dv exact in
    float64 on every rank; each pass that keeps its launches merges and sums once."""
    n, spec, docs, window = _random_balanced_case(seed)
    results = run_ranks(n, one_launch_errors, spec, docs, window, gaps=True, slots=True)
    for r in results:
        for key in KEYS:
            assert r[key] < 1e-10, (key, seed, n, spec, window, r)
        assert r["merged"] == r["summed"] <= 1, (seed, n, spec, window, r)
        if r["gapped_kept"]:
            assert r["merged"] == 1, (seed, n, spec, window, r)


def test_the_one_gpu_test_reaches_fa4s_gapped_launches():
    """tests/gpu/test_one_gpu_ranks.py checks FA4's seqused path (rows and keys read in place
    between gaps) only if its cases make such launches: they do (counted here, on CPU), so that
    coverage cannot vanish unnoticed when the cases or the layouts change."""
    import importlib.util
    import os
    from dtcp.kernels import KERNELS
    from dtcp.plan.fuse import fused_launches
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "test_one_gpu_ranks.py")
    spec = importlib.util.spec_from_file_location("one_gpu_ranks_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gapped = 0
    for name, make_layout, docs, window in module.CASES:
        if docs is None:
            continue
        for n in (2, 4, 8):
            mask = AttnMask.make(True, window, segments_of(docs))
            for plan in ring_plans(make_layout(n, docs), module.S // n, n, True, mask):
                steps = fused_launches(plan, KERNELS["fa4"].reject_varlen_reason) or ()
                gapped += sum((launch.q_span is None and launch.q_in_order) or (launch.k_span is None and launch.k_in_order)
                              for launches in steps for launch in launches)
    assert gapped >= 10, gapped


def direct_write_results(spec, docs, window, heads=(4, 2), batch=1, gaps=False, size=1):
    """ring_attention in bf16 with one-launch steps (in groups of `size` received blocks where
    it is > 1: exec/grouped.py), twice: as it runs (the local step's first launch writes out, lse,
    dq, dk, dv straight into the results; float32 only for the rows and keys that later launches,
    the chains' returns or the groups' shares add to), and with every row and key through float32
    (the hulls forced to all, launch by launch: no slots, exec/fused.py Slots). Returns whether the results are bitwise equal, their dtypes, whether
    the direct writes ran and the ring ran in groups; step by step also the hulls' share of the
    rank's rows and keys."""
    import dtcp.exec.fused as fused_mod
    import dtcp.exec.grouped as grouped_mod
    import dtcp.exec.ring as ring_mod
    from dtcp.kernels.math import MathKernel
    from dtcp.exec.fused import fills_keys, fills_rows, fused_steps, landing, launches_of, takes_gaps
    from dtcp.plan.fuse import later_keys
    executor = grouped_mod if size > 1 else ring_mod  # (whose hulls are forced)
    slots_bytes = dtcp.config.merge_slots_bytes
    dtcp.exec.route.clear_routes()
    MathKernel.varlen_one_launch = True
    MathKernel.varlen_gaps = gaps
    try:
        layout = dtcp.layout_from_spec(spec)
        s = sum(docs)
        g = torch.Generator().manual_seed(5)
        full = [torch.randn(batch, h, s, 16, generator=g).to(torch.bfloat16)
                for h in (heads[0], heads[1], heads[1], heads[0])]
        kwargs = {} if isinstance(layout, (dtcp.Balanced, dtcp.DocZigzag)) else \
            {"cu_seqlens": torch.tensor(_cumulative(docs), dtype=torch.int32)}
        results = []
        with dtcp.config.override(ring_steps_per_launch=size):
            for hulls in ("own", "all"):
                if hulls == "all":  # every later launch on the float32 accumulator, over every row
                    executor.landing = lambda passes, gaps: fused_mod.Landing((0, s), None, (0, s))
                    executor.later_keys = lambda launches, returned: (0, s)
                    dtcp.config.merge_slots_bytes = 0  # (... launch by launch: no slots)
                local = [layout.shard(t, dim=2).detach().requires_grad_() for t in full[:3]]
                out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=True, window_size=window,
                                               return_lse=True, enable_gqa=True, strategy="ring", backend="math",
                                               **kwargs)
                out.backward(layout.shard(full[3], dim=2))
                results.append((out, lse, *(t.grad for t in local)))
        route = _the_route()
        local_len = s // dist.get_world_size()
        fused = fused_steps(route.plan, route.kernel, torch.device("cpu"))
        # (a rank with nothing to fuse runs its steps task by task: no direct writes)
        got = {"direct": fused is not None and fills_rows(fused[0], local_len),
               "launches": sum(map(len, fused)) if fused is not None else None,
               "grouped": grouped_mod.grouped(route.plan, route.kernel, route.steps_per_launch),
               # (the "own" run kept its later launches whole: Slots)
               "slots": size == 1 and fused is not None and fills_rows(fused[0], local_len) and
               sum(map(len, fused)) > 1 and fused_mod.slots_of(fused, torch.device("cpu")) is not None,
               "bitwise": [torch.equal(a, b) for a, b in zip(*results)],
               "dtypes": [str(x.dtype) for x in results[0]]}
        if size == 1:
            launches = launches_of(fused)
            rows_hull = landing(fused, takes_gaps(route.kernel)).acc if fills_rows(fused[0], local_len) \
                else (0, local_len)
            keys_hull = later_keys(launches, route.plan.returned_keys) if fills_keys(fused[0], local_len) \
                else (0, local_len)
            got.update(rows_in_float32=max(0, rows_hull[1] - rows_hull[0]) / local_len,
                       keys_in_float32=max(0, keys_hull[1] - keys_hull[0]) / local_len)
        return got
    finally:
        dtcp.config.merge_slots_bytes = slots_bytes
        executor.landing, executor.later_keys = landing, later_keys
        MathKernel.varlen_one_launch = MathKernel.varlen_gaps = False
        dtcp.exec.route.clear_routes()


DIRECT_CASES = [  # (world size, layout spec, documents, window, heads, batch, gaps)
    (2, "balanced:8,8,8,8", (8, 8, 8, 8), (-1, -1), (4, 2), 1, False),  # every rank: one launch in all
    (2, "balanced:8,8,8", (8, 8, 8), (-1, -1), (4, 2), 1, False),  # one document split: its keys come home
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), (-1, -1), (4, 2), 2, False),
    (4, "balanced@1:40,3,3,2,9,7", (40, 3, 3, 2, 9, 7), (-1, -1), (4, 4), 1, True),
    (3, "balanced@1:5,1,30,12", (5, 1, 30, 12), (4, 0), (4, 2), 1, False),
    (4, "zigzag", (9, 3, 12, 8), (-1, -1), (4, 2), 1, False),
    (4, "doczigzag:16,8,24,8,40,8,16", (16, 8, 24, 8, 40, 8, 16), (-1, -1), (4, 2), 1, True),
]


@pytest.mark.parametrize("n,spec,docs,window,heads,batch,gaps", DIRECT_CASES, ids=str)
def test_the_first_launch_writes_the_results_directly(n, spec, docs, window, heads, batch, gaps):
    """The local step's first launch writes out, lse, dq, dk and dv straight into the call's
    results, and float32 holds only the hull of the rows (keys) that later launches merge or add
    into (and the keys whose shares come home): in bf16, bitwise what float32 accumulators over
    every row and key give (a hull too small loses a later launch's share: not equal). The hulls
    leave rows out on some ranks, so the direct writes are what is compared."""
    results = run_ranks(n, direct_write_results, spec, docs, window, heads, batch, gaps)
    for r in results:
        assert all(r["bitwise"]), r
        assert r["dtypes"][0] == "torch.bfloat16" and r["dtypes"][1] == "torch.float32", r
    assert any(r["direct"] for r in results), results
    if spec in ("zigzag", "balanced:8,8,8"):  # (kept whole, compared with float32 over every row)
        assert any(r["slots"] for r in results), results
    if spec.startswith(("balanced:8,8,8,8", "balanced@1")):
        assert any(r["direct"] and r["rows_in_float32"] < 1 for r in results), results
    if spec == "balanced:8,8,8,8":  # documents held whole: one launch, nothing in float32
        assert all(r["launches"] == 1 and r["rows_in_float32"] == r["keys_in_float32"] == 0 for r in results)
    if spec == "balanced:8,8,8":  # rank 0's pass is one launch, but rank 1's share of its keys comes home
        assert results[0]["rows_in_float32"] == 0 and results[0]["keys_in_float32"] > 0, results


def test_row_and_receive_views_are_the_plain_views():
    """`rows` and `fit_views` build their views with one as_strided each (host ops on a host-bound
    ring): the same elements, strides and storage as x[b].transpose(0, 1) and
    slot.view(-1)[:n].view(shape), for strided inputs too."""
    from dtcp.comm.p2p import fit_views
    from dtcp.exec.fused import rows

    base = torch.randn(3, 4, 12, 6, dtype=torch.float64)
    for x in (base, base[:, :, 2:9], torch.randn(3, 12, 4, 6, dtype=torch.float64).transpose(1, 2), base[1:]):
        for b in range(x.shape[0]):
            want = x[b].transpose(0, 1)
            got = rows(x, b)
            assert got.shape == want.shape and got.stride() == want.stride()
            assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
    slot = [torch.randn(120, dtype=torch.float64), torch.randn(60, dtype=torch.float64)]
    views = fit_views(slot, [(1, 2, 5, 6), (1, 2, 3, 4)])
    for v, t, shape in zip(views, slot, [(1, 2, 5, 6), (1, 2, 3, 4)]):
        want = t.view(-1)[:v.numel()].view(shape)
        assert v.is_contiguous() and v.data_ptr() == t.data_ptr() and torch.equal(v, want)
    with pytest.raises(RuntimeError, match="does not fit"):
        fit_views(slot, [(1, 2, 11, 6), (1, 1, 1, 1)])


def direct_compiled(gaps=False):
    """tests/test_dynamic_shapes.py's compiled Balanced layer (a new placement every step, two
    packed lengths) with one-launch ring steps (`gaps`: reading rows and keys that lie apart in
    place, as FA4 does): how many first launches wrote the results directly (forward, backward),
    how many passes merged kept launches once (and how many of those kept a launch whose rows lie
    apart: one span per range), and its results."""
    from dtcp.exec import ring as ring_mod
    from dtcp.exec import route as route_mod
    from dtcp.kernels.cpu_flash import CpuFlashKernel
    from test_dynamic_shapes import balanced_compiled

    runs = {"into_forward": 0, "into_backward": 0, "merged": 0, "merged_apart": 0}
    into_fwd, into_bwd = CpuFlashKernel.varlen_forward_into, CpuFlashKernel.varlen_backward_into
    merge_slots = ring_mod.merge_slots_

    def counted_merge(out, lse, slot_out, slot_lse, spans, table):
        runs["merged"] += 1
        runs["merged_apart"] += len({span[3] for span in spans}) < len(spans)  # a launch of several spans
        return merge_slots(out, lse, slot_out, slot_lse, spans, table)

    def counted_fwd(self, *a, **k):
        runs["into_forward"] += 1
        return into_fwd(self, *a, **k)

    def counted_bwd(self, *a, **k):
        runs["into_backward"] += 1
        return into_bwd(self, *a, **k)

    CpuFlashKernel.varlen_forward_into, CpuFlashKernel.varlen_backward_into = counted_fwd, counted_bwd
    ring_mod.merge_slots_ = counted_merge
    CpuFlashKernel.varlen_one_launch = True  # (the kernel "auto" takes on CPU; its varlen loop stands in)
    CpuFlashKernel.varlen_gaps = gaps
    try:
        return {**balanced_compiled("aot_eager"), **runs}
    finally:
        CpuFlashKernel.varlen_forward_into, CpuFlashKernel.varlen_backward_into = into_fwd, into_bwd
        ring_mod.merge_slots_ = merge_slots
        CpuFlashKernel.varlen_one_launch = False
        CpuFlashKernel.varlen_gaps = False
        route_mod.clear_routes()


@pytest.mark.parametrize("gaps", [False, True], ids=["gather", "gaps"])
def test_direct_first_launch_compiled_with_new_documents_every_step(gaps):
    """torch.compile(fullgraph=True), aot_eager, 2 ranks, one-launch ring steps whose first launch
    writes the results: equal to eager (out and every gradient), no graph break, no recompile for
    a new document mix, one for the new packed length; the direct writes ran, compiled and eager.
    With `gaps`, later launches whose rows lie apart are kept whole in slots too and merged once a
    pass (a launch of several spans)."""
    from test_dynamic_shapes import BALANCED_STEPS
    first_new_length = next(i for i, (s, _) in enumerate(BALANCED_STEPS) if s != BALANCED_STEPS[0][0])
    results = run_ranks(2, direct_compiled, gaps, timeout=400)
    for r in results:
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["into_forward"] >= 2 * len(BALANCED_STEPS) and r["into_backward"] >= 2 * len(BALANCED_STEPS), r
        assert r["frames"][:first_new_length] == [1] * first_new_length, r
        assert r["frames"][first_new_length:] == [2] * (len(BALANCED_STEPS) - first_new_length), r
    if gaps:
        assert sum(r["merged_apart"] for r in results) > 0, results
    else:  # (rows gathered: such launches land launch by launch)
        assert sum(r["merged_apart"] for r in results) == 0, results


def test_row_runs_route_each_row_once_through_its_launches():
    """plan/fuse.py row_runs: each later launch's rows as runs (start, end, role), in order,
    covering exactly its rows; a row one later launch reaches is ONLY there, a row several reach
    is FIRST in the first, MID between, LAST in the last (so the result is read once and written
    once, and float32 holds it only between). A hand case, then random passes checked row by row;
    gathered rows (no varlen gaps) and passes of more than MAX_RUNS runs a launch keep the hull."""
    from dtcp.plan.fuse import FIRST, LAST, MAX_RUNS, MID, ONLY, Launch, row_runs

    first = Launch((-1, 0), ((0, 10),), ((0, 10),))
    a = Launch((-1, -1), ((2, 6),), ((0, 4),))
    b = Launch((-1, -1), ((4, 8),), ((0, 4),))
    c = Launch((-1, -1), ((5, 6),), ((0, 4),))
    assert row_runs((first, a, b, c), False) == (
        ((2, 4, ONLY), (4, 6, FIRST)),
        ((4, 5, LAST), (5, 6, MID), (6, 8, ONLY)),
        ((5, 6, LAST),),
    )
    assert row_runs((first,), False) == ()
    apart = Launch((-1, -1), ((0, 2), (7, 8)), ((0, 3), (5, 6)))  # rows lying apart, in order
    assert row_runs((first, apart), False) is None  # gathered: the hull
    assert row_runs((first, apart), True) == (((0, 2, ONLY), (7, 8, ONLY)),)
    many = Launch((-1, -1), tuple((2 * i, 2 * i + 1) for i in range(MAX_RUNS + 1)), ((0, 1),) * (MAX_RUNS + 1))
    assert row_runs((Launch((-1, 0), ((0, 40),), ((0, 40),)), many), True) is None

    rng = random.Random(7)
    for _ in range(300):
        length = rng.randint(4, 40)
        later = []
        for _ in range(rng.randint(1, 6)):
            cuts = sorted(rng.sample(range(length + 1), 2 * rng.randint(1, min(3, (length + 1) // 2))))
            ranges = tuple((x, y) for x, y in zip(cuts[::2], cuts[1::2]) if y > x)
            if ranges:
                later.append(Launch((-1, -1), ranges, ((0, 1),) * len(ranges)))
        runs = row_runs((Launch((-1, 0), ((0, length),), ((0, length),)),) + tuple(later), True)
        if runs is None:
            assert any(len(launch.q_ranges) > 1 for launch in later)  # (only MAX_RUNS can refuse here)
            continue
        seen = [[] for _ in range(length)]
        for launch, mine in zip(later, runs):
            rows = sorted(r for x, y in launch.q_ranges for r in range(x, y))
            assert sorted(r for x, y, _ in mine for r in range(x, y)) == rows
            assert all(p[1] <= q[0] for p, q in zip(mine, mine[1:]))  # in order, disjoint
            for x, y, role in mine:
                for r in range(x, y):
                    seen[r].append(role)
        for roles in seen:
            assert roles in ([], [ONLY]) or (roles[0] == FIRST and roles[-1] == LAST and len(roles) >= 2
                                             and all(m == MID for m in roles[1:-1])), roles


def merged_between_result_and_accumulator(device: str, role: str, masked: bool, h: int, length: int, d: int):
    """One merge as routed rows run it (exec/merge.py merge_into_ with a source of its own), and
    the float32 path it must equal: from the bf16 result into itself ("only"), from it into the
    float32 accumulator ("first"), from the accumulator into it ("last"). Returns (written, what
    it held before, the float32 path's values, lse, the float32 path's lse, rows merged, the
    tensors the merge read and wrote)."""
    from dtcp.exec import merge as M
    g = torch.Generator(device=device).manual_seed(5)
    result = torch.randn(1, h, length, d, device=device, generator=g).to(torch.bfloat16)
    acc = torch.randn(1, h, length, d, device=device, generator=g)
    lse = torch.randn(1, h, length, device=device, generator=g)
    lse[:, :, :length // 20] = float("-inf")  # rows that have seen no key yet
    blk = torch.randn(1, h, length, d, device=device, generator=g).to(torch.bfloat16)
    blk_lse = torch.randn(1, h, length, device=device, generator=g)
    used = (torch.rand(length, device=device, generator=g) < 0.6) if masked else None
    keep = torch.ones(length, dtype=torch.bool, device=device) if used is None else used
    src32 = acc.clone() if role == "last" else result.float()  # the float32 path
    want_lse = lse.clone()
    M.merge_into_(src32, want_lse, blk, blk_lse, rows_used=used)
    got_lse, got_result, got_acc = lse.clone(), result.clone(), acc.clone()
    if role == "only":
        M.merge_into_(got_result, got_lse, blk, blk_lse, rows_used=used)
        return got_result, result, src32.to(torch.bfloat16), got_lse, want_lse, keep, (got_result, got_result)
    if role == "first":
        M.merge_into_(got_acc, got_lse, blk, blk_lse, rows_used=used, out_src=got_result)
        return got_acc, acc, src32, got_lse, want_lse, keep, (got_result, got_acc)
    M.merge_into_(got_result, got_lse, blk, blk_lse, rows_used=used, out_src=got_acc)
    return got_result, result, src32.to(torch.bfloat16), got_lse, want_lse, keep, (got_acc, got_result)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("role", ["only", "first", "last"])
def test_torch_merge_between_the_result_and_the_accumulator(role, masked):
    """The merge that routed rows run (exec/merge.py, torch on CPU; the Triton twin is
    tests/gpu/test_one_gpu_ranks.py's): from the bf16 result into itself, from it into the float32
    accumulator, from the accumulator into it: the bits of the float32 path (the result copied into
    float32, merged in place, cast back); rows a row mask leaves out are not written."""
    written, before, want, lse, want_lse, keep, _ = merged_between_result_and_accumulator("cpu", role, masked, 3, 200, 16)
    assert torch.equal(written[:, :, keep], want[:, :, keep]) and torch.equal(lse, want_lse)
    assert torch.equal(written[:, :, ~keep], before[:, :, ~keep])
    assert (~keep).any() if masked else keep.all()


@pytest.mark.parametrize("gaps", [False, True])
def test_launch_index_tensors_hold_the_ranges_and_start_16_bytes_apart(gaps):
    """A launch's cu_seqlens and seqused tensors hold its sequences' starts and lengths, each at an
    address that is a multiple of 16 bytes: FlashAttention-4's backward copies any such tensor
    that is not (an allocation and a copy kernel per launch, every step of every pass)."""
    from dtcp.exec.fused import _indexed
    from dtcp.kernels.base import int32_rows
    from dtcp.plan.fuse import Launch

    for lens in ([1, 2, 3], [0, 5, 7, 9], [4], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]):
        got = int32_rows([lens, lens[:-1] or [2]], "cpu")
        assert [t.tolist() for t in got] == [lens, lens[:-1] or [2]]
        assert all(t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in got)
    # 3, 2 and 6 sequences: cu_seqlens of 4, 3 and 7 entries; rows apart in order (gaps) or tiling
    for n_seqs in (3, 2, 6):
        q_ranges = tuple((10 * i, 10 * i + 4) for i in range(n_seqs))
        k_ranges = tuple((7 * i, 7 * i + 5) for i in range(n_seqs))
        li = _indexed(Launch((-1, 0), q_ranges, k_ranges), torch.device("cpu"), gaps=gaps)
        seqs = li.seqs
        assert seqs.cu_q_t.tolist() == list(seqs.cu_q) and seqs.cu_k_t.tolist() == list(seqs.cu_k)
        tensors = [seqs.cu_q_t, seqs.cu_k_t]
        if gaps:  # the rows and keys lie apart in order: read in place, lengths as seqused
            assert seqs.used_q_t.tolist() == [4] * n_seqs and seqs.used_k_t.tolist() == [5] * n_seqs
            assert list(seqs.cu_q) == [10 * i for i in range(n_seqs)] + [10 * (n_seqs - 1) + 4]
            tensors += [seqs.used_q_t, seqs.used_k_t]
        else:
            assert seqs.used_q_t is None and list(seqs.cu_q) == [4 * i for i in range(n_seqs + 1)]
        assert all(t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)
