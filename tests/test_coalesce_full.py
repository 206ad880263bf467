"""plan/mask.py coalesce_full: the merges of full tasks that tile larger rectangles, found by their
edges (O(n log n)), give exactly what the first form gave (rescanning every pair after each merge,
kept here as the reference) on random disjoint tasks and on the steps of real plans."""

from __future__ import annotations

import random

import pytest

import dtcp
from dtcp.plan import AttnMask, ring_plans
from dtcp.plan import mask as mask_module
from dtcp.plan.mask import Task, coalesce_full
from sim_ranks import segments_of


def coalesce_full_by_rescanning(tasks: list[Task]) -> list[Task]:
    """The first form: after each merge, scan every pair again from the start of the list."""
    changed = True
    while changed:
        changed = False
        for x in range(len(tasks)):
            a = tasks[x]
            if not a.is_full:
                continue
            for y in range(len(tasks)):
                b = tasks[y]
                if y == x or not b.is_full:
                    continue
                if (a.k_start, a.k_end) == (b.k_start, b.k_end) and a.q_end == b.q_start:
                    m = Task(a.q_start, b.q_end, a.k_start, a.k_end)
                elif (a.q_start, a.q_end) == (b.q_start, b.q_end) and a.k_end == b.k_start:
                    m = Task(a.q_start, a.q_end, a.k_start, b.k_end)
                else:
                    continue
                tasks = [t for i, t in enumerate(tasks) if i not in (x, y)] + [m]
                changed = True
                break
            if changed:
                break
    return sorted(tasks, key=lambda t: (t.q_start, t.k_start))


def random_disjoint_tasks(rng: random.Random) -> list[Task]:
    """Cells of a random grid (some left out, some causal instead of full), in random order:
    disjoint tasks with many neighbours, as a step's tasks are."""
    def cuts(n):
        inner = sorted(rng.sample(range(1, 40), rng.randint(0, n)))
        return [0] + inner + [40 + rng.randint(0, 5)]
    qs, ks = cuts(rng.randint(1, 9)), cuts(rng.randint(1, 9))
    tasks = []
    for qa, qb in zip(qs, qs[1:]):
        for ka, kb in zip(ks, ks[1:]):
            r = rng.random()
            if r < 0.15:
                continue
            tasks.append(Task(qa, qb, ka, kb, None, 0) if r < 0.3 else Task(qa, qb, ka, kb))
    rng.shuffle(tasks)
    return tasks


def test_same_merges_as_rescanning():
    merged = 0
    for seed in range(300):
        tasks = random_disjoint_tasks(random.Random(seed))
        got = coalesce_full(list(tasks))
        assert got == coalesce_full_by_rescanning(list(tasks)), seed
        merged += len(tasks) - len(got)
    assert merged > 1000  # (the sets had merges to make)


@pytest.mark.parametrize("layout, docs, n", [
    ("doczigzag", (700, 90, 1300, 33, 260, 5, 411, 77, 2048, 160, 64, 999), 4),
    ("doczigzag", (512, 3, 3, 1000, 120, 87, 640, 31), 8),
    ("zigzag", (700, 90, 1300, 33, 260, 5, 411, 77, 2048, 160, 64, 999), 8),
    ("balanced", (1705, 90, 1300, 33, 260, 5, 411, 77, 2048, 160, 64, 999), 8),
], ids=str)
def test_plans_unchanged(layout, docs, n, monkeypatch):
    """Every step of every rank's ring plan: the same tasks with either form."""
    lay = {"doczigzag": lambda: dtcp.DocZigzag(docs), "zigzag": dtcp.Zigzag,
           "balanced": lambda: dtcp.Balanced(docs, min_chunk=64)}[layout]()
    if layout == "doczigzag":
        seq_len, segments = lay.padded_len(n), lay.segments(n)
    else:
        seq_len, segments = sum(docs) + (-sum(docs)) % lay.multiple(n), segments_of(docs)
    mask = AttnMask.make(True, (-1, -1), tuple(segments))
    ring_plans.cache_clear()
    fast = ring_plans(lay, seq_len // n, n, True, mask)
    ring_plans.cache_clear()
    monkeypatch.setattr(mask_module, "coalesce_full", coalesce_full_by_rescanning)
    slow = ring_plans(lay, seq_len // n, n, True, mask)
    ring_plans.cache_clear()
    assert sum(t.is_full for p in fast for s in p.steps for t in s.tasks) >= n  # merges to make
    for p, q in zip(fast, slow):
        assert [s.tasks for s in p.steps] == [s.tasks for s in q.steps]


def test_overlapping_tasks_are_refused():
    with pytest.raises(AssertionError, match="overlapping"):
        coalesce_full([Task(0, 4, 0, 4), Task(0, 4, 0, 4)])
