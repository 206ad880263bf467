"""The per-step schedule, checked against brute-force masks from the layouts' global positions.
Pure Python: no process group."""

from __future__ import annotations

import pytest
import torch

import dtcp
from dtcp.plan import ring_plan

LAYOUTS = [dtcp.Contiguous(), dtcp.Zigzag(), dtcp.Striped(1), dtcp.Striped(2), dtcp.Striped(3)]


def coverage(plan, local_len):
    """How many times each (query, key) pair of each step is computed."""
    counts = {}
    for step in plan.steps:
        c = torch.zeros(local_len, local_len, dtype=torch.int64)
        for t in step.tasks:
            for i in range(t.q_len):
                for j in range(t.k_len):
                    if t.visible(i, j):
                        c[t.q_start + i, t.k_start + j] += 1
        counts[step.src] = c
    return counts


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("is_causal", [True, False])
def test_schedule_covers_exactly_the_visible_pairs(layout, world_size, is_causal):
    seq_len = layout.multiple(world_size) * 2
    local_len = seq_len // world_size
    for rank in range(world_size):
        plan = ring_plan(layout, local_len, world_size, rank, is_causal)
        assert [s.src for s in plan.steps] == [(rank - t) % world_size for t in range(world_size)]
        assert plan.num_rounds == world_size - 1
        counts = coverage(plan, local_len)
        q_pos = layout.global_positions(seq_len, world_size, rank)
        for src, c in counts.items():
            k_pos = layout.global_positions(seq_len, world_size, src)
            truth = (k_pos[None, :] <= q_pos[:, None]) if is_causal else torch.ones(local_len, local_len, dtype=torch.bool)
            assert torch.equal(c, truth.long()), (rank, src)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
def test_tasks_are_trimmed_and_causal_tasks_square(layout):
    world_size = 4
    local_len = layout.multiple(world_size) * 3 // world_size
    for rank in range(world_size):
        for step in ring_plan(layout, local_len, world_size, rank, True).steps:
            for t in step.tasks:
                assert t.q_len > 0 and t.k_len > 0
                rows = [any(t.visible(i, j) for j in range(t.k_len)) for i in range(t.q_len)]
                cols = [any(t.visible(i, j) for i in range(t.q_len)) for j in range(t.k_len)]
                assert all(rows) and all(cols), t  # no masked-out row or column is computed
                assert t.is_full or t.is_square_causal, t


def test_zigzag_is_balanced_and_one_call_per_step():
    n, local_len = 4, 16
    for rank in range(n):
        plan = ring_plan(dtcp.Zigzag(), local_len, n, rank, True)
        work = [sum(t.q_len * t.k_len for t in s.tasks) for s in plan.steps[1:]]
        assert all(len(s.tasks) == 1 for s in plan.steps)
        assert work == [local_len * local_len // 2] * (n - 1)


def test_layout_positions_partition_the_sequence():
    for layout in LAYOUTS:
        for n in (1, 2, 3, 4):
            s = layout.multiple(n) * 2
            perm = layout.permutation(s, n)
            assert sorted(perm.tolist()) == list(range(s))
            for r in range(n):
                pos = layout.global_positions(s, n, r)
                assert torch.all(pos[1:] > pos[:-1])  # local order is global order


def test_layout_pictures_in_docs():
    assert dtcp.Zigzag().global_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert dtcp.Zigzag().global_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert dtcp.Striped(2).global_positions(16, 2, 1).tolist() == [2, 3, 6, 7, 10, 11, 14, 15]
    assert dtcp.Striped().global_positions(16, 2, 0).tolist() == list(range(0, 16, 2))
    assert dtcp.layout_from_spec("striped:3") == dtcp.Striped(3)


def test_layout_positional_arguments_are_not_dim():
    # `dim` (placement use) is keyword-only: positional arguments keep their meaning.
    assert dtcp.SlidingWindow(64).left == 64 and dtcp.SlidingWindow(64).dim is None
    assert dtcp.Striped(2).block == 2 and dtcp.Striped(2).dim is None
    assert dtcp.Zigzag(dim=1).dim == 1


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
@pytest.mark.parametrize("window", [(-1, -1), (6, 0)])
def test_rank_pairs_that_share_no_document_plan_no_tasks_exactly(world_size, window):
    """ring_plans skips the band tasks of rank pairs whose runs reach no common document (most
    pairs of a packed batch at 8-16 ranks): every step's tasks are still exactly band_tasks of its
    rank pair, and an offset the plans leave out has none for any rank. Long-tailed documents on
    Balanced and zigzag, causal and a causal window."""
    import random

    from dtcp.plan import AttnMask, ring_plans
    from dtcp.plan.mask import band_tasks

    rng = random.Random(world_size)
    docs = [max(1, int(rng.paretovariate(0.9))) for _ in range(60)]
    docs[-1] += -sum(docs) % (2 * world_size)
    seq_len = sum(docs)
    segments, pos = [], 0
    for d in docs:
        segments.append((pos, pos + d))
        pos += d
    mask = AttnMask.make(True, window, tuple(segments))
    for layout in (dtcp.Balanced(tuple(docs), min_chunk=1), dtcp.Zigzag()):
        plans = ring_plans(layout, seq_len // world_size, world_size, True, mask)
        runs = [layout.runs(seq_len, world_size, r) for r in range(world_size)]
        for r, plan in enumerate(plans):
            for step in plan.steps:
                assert list(step.tasks) == band_tasks(runs[r], runs[step.src], mask, seq_len), (layout, r, step.src)
            planned = {step.src for step in plan.steps}
            for src in set(range(world_size)) - planned:
                assert band_tasks(runs[r], runs[src], mask, seq_len) == [], (layout, r, src)
