"""The one-process N-rank ring (dtcp.comm.simulated) is the real ring: in float64 on CPU its out,
lse, dq, dk and dv equal single-process attention to 1e-10, for plain and fused step launches, so
the one-GPU test (tests/gpu/test_one_gpu_ranks.py) measures the kernels' numerics, not the harness."""

from __future__ import annotations

import functools

import pytest
import torch

import dtcp
from dtcp.kernels import KERNELS
from reference import exact_err, reference_attention, window_doc_mask
from sim_ranks import simulated_allgather, simulated_allgather_tasks, simulated_ring, simulated_ulysses

CASES = [  # (world size, layout, documents, window)
    (2, dtcp.Zigzag(), None, (-1, -1)),
    (4, dtcp.Balanced((40, 3, 3, 2, 9, 7), min_chunk=1), (40, 3, 3, 2, 9, 7), (-1, -1)),
    (3, dtcp.Contiguous(), (20, 2, 14), (5, 0)),
    (8, dtcp.Balanced((33, 2, 1, 4, 9, 5, 2, 8), min_chunk=1), (33, 2, 1, 4, 9, 5, 2, 8), (-1, -1)),
]


@pytest.mark.parametrize("n,layout,docs,window", CASES, ids=str)
@pytest.mark.parametrize("one_launch", [False, True, "index"])
def test_simulated_ranks_are_exact(n, layout, docs, window, one_launch, monkeypatch):
    """one_launch "index": fused, with scattered rows and keys through index_select/index_add_
    instead of a copy per range (what launches of more than MAX_RANGES ranges take)."""
    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", bool(one_launch))
    if one_launch == "index":
        monkeypatch.setattr(dtcp.exec.fused, "MAX_RANGES", 0)
    assert_simulation_exact(simulated_ring, n, layout, docs, window, heads=(4, 4, 4, 4), seed=5)


@pytest.mark.parametrize("n,layout,docs,window", CASES, ids=str)
@pytest.mark.parametrize("size", [2, 3])
def test_simulated_ranks_in_groups_are_exact(n, layout, docs, window, size, monkeypatch):
    """The ring with its blocks in groups (dtcp.config.ring_steps_per_launch) over the simulated
    ranks' direct transfers: what the one-GPU test runs with FA4."""
    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", True)
    with dtcp.config.override(ring_steps_per_launch=size):
        assert_simulation_exact(simulated_ring, n, layout, docs, window, heads=(4, 4, 4, 4), seed=5)


SLOT_CASES = [(n, dtcp.Zigzag(), None, (-1, -1)) for n in (2, 4, 8)] + [
    (3, dtcp.Contiguous(), None, (5, 0)), (4, dtcp.Contiguous(), (9, 14, 3, 6), (-1, -1)),
    (4, dtcp.Contiguous(), None, (-1, -1))] + CASES  # (the last: later steps' tasks of equal values)


@pytest.mark.parametrize("n,layout,docs,window", SLOT_CASES, ids=str)
@pytest.mark.parametrize("one_launch", [False, True], ids=["tasks", "launches"])
@pytest.mark.parametrize("slots", [True, False], ids=["slots", "launch_by_launch"])
def test_later_launches_kept_whole_are_exact(n, layout, docs, window, one_launch, slots, monkeypatch):
    """A pass whose local step writes the results keeps its later tasks' (launches') outputs and
    dQ whole and merges (sums) them once at its end (exec/fused.py Slots; task by task: plain
    causal zigzag, windows, documents on contiguous ranks): exact in float64, and counted (every
    rank with a later task merges once a pass and sums once, forward and backward; none with
    dtcp.config.merge_slots_bytes = 0, or when the slots would pass it)."""
    from dtcp.exec import ring
    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", one_launch)
    calls = {"merge": 0, "sum": 0}
    merge_slots, sum_slots = ring.merge_slots_, ring.sum_slots_
    monkeypatch.setattr(ring, "merge_slots_", lambda *a: calls.__setitem__("merge", calls["merge"] + 1)
                        or merge_slots(*a))
    monkeypatch.setattr(ring, "sum_slots_", lambda *a: calls.__setitem__("sum", calls["sum"] + 1) or sum_slots(*a))
    with dtcp.config.override(merge_slots_bytes=dtcp.config.merge_slots_bytes if slots else 0):
        assert_simulation_exact(simulated_ring, n, layout, docs, window, heads=(4, 2, 2, 4), seed=9)
    assert calls["merge"] == calls["sum"], calls
    if not slots:
        assert calls["merge"] == 0
    elif not one_launch and docs is None:  # task by task: every rank with later tasks (contiguous: not rank 0)
        assert calls["merge"] == (n if isinstance(layout, dtcp.Zigzag) else n - 1), calls
    if slots:  # ... and none where they would pass the setting (one byte)
        calls.update(merge=0, sum=0)
        with dtcp.config.override(merge_slots_bytes=1):
            assert_simulation_exact(simulated_ring, n, layout, docs, window, heads=(4, 2, 2, 4), seed=9)
        assert calls == {"merge": 0, "sum": 0}, calls


def assert_simulation_exact(schedule, n, layout, docs, window, heads, seed):
    """`schedule` (tests/sim_ranks.py) on float64 inputs equals single-process attention to 1e-10."""
    s = sum(docs) if docs else 8 * n
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, h, s, 8, generator=g, dtype=torch.float64) for h in heads)
    mask = window_doc_mask(s, is_causal=True, window=window, cu_seqlens=None if docs is None else
                           [0] + [sum(docs[:i + 1]) for i in range(len(docs))])
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, mask=mask)
    out_ref.backward(dout)
    got = schedule(layout, n, q, k, v, dout, KERNELS["math"], window=window, docs=docs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, (out_ref, lse_ref, *(t.grad for t in ref))):
        assert exact_err(a, b) < 1e-10, name


@pytest.mark.parametrize("exchange", [True, False], ids=["keys_read_across_ranks", "whole_shards"])
@pytest.mark.parametrize("n,layout,docs,window", [c for c in CASES if c[2] is not None], ids=str)
def test_simulated_allgather_is_exact(n, layout, docs, window, exchange):
    """The one-process all-gather (one varlen call per rank, one thread each; the keys other ranks
    read exchanged for real and their dK/dV sent back, or every rank's K/V gathered and dK/dV
    summed over the ranks' shares) equals single-process attention: the one-GPU test measures
    kernels only."""
    schedule = functools.partial(simulated_allgather, exchange=exchange)
    assert_simulation_exact(schedule, n, layout, docs, window, heads=(4, 2, 2, 4), seed=6)


TASK_CASES = [(n, dtcp.Zigzag(), None, (-1, -1)) for n in (2, 4, 8)] + [
    (3, dtcp.Contiguous(), None, (5, 0)), (4, dtcp.Contiguous(), None, (-1, -1))]


@pytest.mark.parametrize("n,layout,docs,window", TASK_CASES, ids=str)
def test_simulated_allgather_by_task_is_exact(n, layout, docs, window):
    """The one-process all-gather task by task (AllGatherPlan: K/V put in token order piece by
    piece, dK/dV summed by first-copy-then-add and sent back rank-major piece by piece) equals
    single-process attention: what the one-GPU test runs with FA4 and flash."""
    assert_simulation_exact(simulated_allgather_tasks, n, layout, docs, window, heads=(4, 2, 2, 4), seed=8)


@pytest.mark.parametrize("n,layout,docs,window", CASES + [(4, dtcp.Zigzag(), (5, 9, 2, 16), (-1, -1)),
                                                      (2, dtcp.DocZigzag((4, 12, 8)), (4, 12, 8), (-1, -1))], ids=str)
@pytest.mark.parametrize("keep", [False, True], ids=["op", "eager"])
def test_simulated_ulysses_is_exact(n, layout, docs, window, keep):
    """The one-process Ulysses (each rank's route as dtcp builds it, run by its own head-exchange
    forward and backward; the all-to-alls carry every rank's real bytes) equals single-process
    attention, with the op's backward (exchanging again) and the eager one (keeping the exchanged
    tensors). K/V heads fewer than the ranks at N = 4 and 8 (replicated, their gradients summed)."""
    heads = (2 * n, 2, 2, 2 * n) if n % 2 == 0 else (2 * n, n, n, 2 * n)
    assert_simulation_exact(lambda *a, **kw: simulated_ulysses(*a, keep=keep, **kw), n, layout, docs, window,
                            heads=heads, seed=7)


def test_simulated_ulysses_raises_when_a_rank_fails(monkeypatch):
    """A rank that fails inside the head exchange breaks the others' wait: the error comes back
    at once, not after the barrier's timeout."""
    import time

    from dtcp.exec import ulysses as ul
    real = ul.to_sequence

    def fails_on_rank_1(tensors, plan, pg, *a, **kw):
        if pg == 1:
            raise RuntimeError("rank 1 failed")
        return real(tensors, plan, pg, *a, **kw)

    monkeypatch.setattr(ul, "to_sequence", fails_on_rank_1)
    monkeypatch.setattr("dtcp.exec.route.to_sequence", fails_on_rank_1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        assert_simulation_exact(simulated_ulysses, 2, dtcp.Zigzag(), None, (-1, -1), heads=(4, 2, 2, 4), seed=7)
    assert time.monotonic() - start < 30


def test_fused_accumulators_start_as_the_local_launch(monkeypatch):
    """Where the local step's first launch covers every row (and key), the fused ring's float32
    accumulators start as its copy instead of zeros plus a merge; the Balanced cases above take
    that path on every rank with more than one call (so test_simulated_ranks_are_exact checks
    it), with dQ and own dK/dV alike, and the copy is counted: no merge and no add for that
    launch."""
    from dtcp.exec import fused as F
    from dtcp.plan import AttnMask, ring_plans
    from sim_ranks import segments_of

    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", True)
    checked = 0
    for n, layout, docs, window in CASES:
        if not isinstance(layout, dtcp.Balanced):
            continue
        mask = AttnMask.make(True, window, segments_of(docs))
        for plan in ring_plans(layout, sum(docs) // n, n, True, mask):
            steps = F.fused_steps(plan, KERNELS["math"], torch.device("cpu"))
            if len(plan.tasks) == 1:  # a rank holding one document whole: one call, nothing to fuse
                assert steps is None
                continue
            checked += 1
            assert steps is not None and F.fills_rows(steps[0], sum(docs) // n), (n, plan.rank)
            assert F.fills_keys(steps[0], sum(docs) // n), (n, plan.rank)
    assert checked >= 10, checked
    merges = []
    monkeypatch.setattr(dtcp.exec.ring, "merge_launch_", lambda *a: merges.append(a[3]) or F.merge_launch_(*a))
    n, layout, docs, window = CASES[1]
    with dtcp.config.override(merge_slots_bytes=0):  # (launch by launch: no slots, exec/fused.py Slots)
        assert_simulation_exact(simulated_ring, n, layout, docs, window, heads=(4, 4, 4, 4), seed=5)
    launches = sum(len(s) for p in ring_plans(layout, sum(docs) // n, n, True,
                                              AttnMask.make(True, window, segments_of(docs)))
                   for s in F.fused_steps(p, KERNELS["math"], torch.device("cpu")))
    assert len(merges) == launches - n  # every launch merges but each rank's first


# ---- dK/dV handed over unrounded (kv_dtype): replicated K/V heads of the head exchange ----------

def _bf16(n_tokens, heads, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n_tokens, 8, generator=g).to(torch.bfloat16) for h in heads]


def _assert_unrounded(base, wide):
    """`wide` (kv_dtype=float32) against `base` (the call without it), both on bfloat16 inputs:
    out, lse and dq the same bits; dk and dv float32 whose rounding to bfloat16 is, bit for bit,
    base's (the same sums, the one rounding left to the caller), and which hold more bits than
    bfloat16 somewhere (keys that took several shares)."""
    for a, b in zip(base[:3], wide[:3]):
        assert torch.equal(a, b)
    assert all(t.dtype == torch.bfloat16 for t in base[3:]) and all(t.dtype == torch.float32 for t in wide[3:])
    for a, b in zip(base[3:], wide[3:]):
        assert torch.equal(b.to(torch.bfloat16), a)
    assert any(not torch.equal(b, b.to(torch.bfloat16).float()) for b in wide[3:])


@pytest.mark.parametrize("n,layout,docs,window", CASES, ids=str)
@pytest.mark.parametrize("one_launch,size", [(False, 1), (True, 1), (True, 2)], ids=["tasks", "launches", "groups"])
def test_ring_hands_dkv_over_unrounded(n, layout, docs, window, one_launch, size, monkeypatch):
    """ring_backward and grouped_backward with kv_dtype=float32 (what the head exchange asks of its
    inner ring where K/V heads are replicated: exec/route.py `_heads_backward`), on bfloat16: the
    local step's own results (task by task), the first launch's direct results (fused) and the
    groups' (ring_steps_per_launch) all widened exactly, every sum unrounded."""
    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", one_launch)
    q, k, v, dout = _bf16(sum(docs) if docs else 8 * n, (4, 2, 2, 4), seed=11)
    with dtcp.config.override(ring_steps_per_launch=size):
        base = simulated_ring(layout, n, q, k, v, dout, KERNELS["math"], window=window, docs=docs)
        wide = simulated_ring(layout, n, q, k, v, dout, KERNELS["math"], window=window, docs=docs,
                              kv_dtype=torch.float32)
    _assert_unrounded(base, wide)


@pytest.mark.parametrize("n,layout,docs,window", [c for c in CASES if c[2] is not None], ids=str)
def test_allgather_over_documents_hands_dkv_over_unrounded(n, layout, docs, window, monkeypatch):
    """varlen_backward with kv_dtype=float32 (the key exchange's dK/dV sums) on bfloat16."""
    monkeypatch.setattr(type(KERNELS["math"]), "varlen_one_launch", True)
    q, k, v, dout = _bf16(sum(docs), (4, 2, 2, 4), seed=12)
    base = simulated_allgather(layout, n, q, k, v, dout, KERNELS["math"], window=window, docs=docs)
    wide = simulated_allgather(layout, n, q, k, v, dout, KERNELS["math"], window=window, docs=docs,
                               kv_dtype=torch.float32)
    _assert_unrounded(base, wide)


@pytest.mark.parametrize("replicated", [True, False])
def test_head_exchange_asks_its_inner_schedule_for_float32_sums(replicated, monkeypatch):
    """The head exchange's backward asks its inner schedule for float32 dK/dV exactly where it sums
    a K/V head's replicas (Hkv < U) under half inputs, and its results are the inputs' dtype."""
    from dtcp.exec import route as R
    asked = []
    real = R._backward

    def spy(*args, kv_dtype=None):
        asked.append(kv_dtype)
        return real(*args, kv_dtype=kv_dtype)

    monkeypatch.setattr(R, "_backward", spy)
    n = 4
    heads = (2 * n, 2, 2, 2 * n) if replicated else (2 * n, n, n, 2 * n)
    q, k, v, dout = _bf16(8 * n, heads, seed=13)
    got = simulated_ulysses(dtcp.Zigzag(), n, q, k, v, dout, KERNELS["math"])
    assert asked == [torch.float32 if replicated else None] * n, asked
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
