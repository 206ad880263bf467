"""plan/mask.py band_tasks looks only at the documents some key run reaches (a rank's query runs
span most of a batch's documents, another rank's key runs few of them). It must give the tasks the
form that walked every document gave, in the same order: checked on random runs, masks and
documents (padding between them included), and on every rank pair of real layouts' runs."""

from __future__ import annotations

import bisect
import random

import pytest

import dtcp
from dtcp.plan.mask import AttnMask, Band, Task, band_tasks, coalesce_full


def band_tasks_every_document(q_run_list, k_run_list, mask: AttnMask, seq_len: int):
    """dtcp/plan/mask.py band_tasks before it looked only at the documents key runs reach."""
    lo, hi = mask.lo, mask.hi
    segs = mask.segments if mask.segments is not None else ((0, seq_len),)
    seg_starts = [a for a, _ in segs]
    k_runs, ko = [], 0
    for ka, kb in k_run_list:
        k_runs.append((ka, kb, ko))
        ko += kb - ka
    # Searched in global order (a layout may hold its runs in another local order: Balanced puts
    # the runs it shares with other ranks first); `ko` keeps each run's local offset.
    k_runs.sort()
    k_starts = [ka for ka, _, _ in k_runs]
    tasks = []
    qo = 0
    for qa, qb in q_run_list:
        for ds, de in segs[max(bisect.bisect_right(seg_starts, qa) - 1, 0):]:
            if ds >= qb:
                break
            # keys this document and the band allow for these queries
            key_lo = max(ds, qa + lo) if lo is not None else ds
            key_hi = min(de, qb + hi) if hi is not None else de
            for ka, kb, ko in k_runs[max(bisect.bisect_right(k_starts, key_lo) - 1, 0):]:
                if ka >= key_hi:
                    break
                i0, i1, j0, j1 = max(qa, ds), min(qb, de), max(ka, ds), min(kb, de)
                if i0 >= i1 or j0 >= j1:
                    continue
                # rows that see some key in [j0, j1): j0 - hi <= i <= j1 - 1 - lo
                if hi is not None:
                    i0 = max(i0, j0 - hi)
                if lo is not None:
                    i1 = min(i1, j1 - lo)
                if i0 >= i1:
                    continue
                # columns seen by some kept row; bands are monotone, so every kept row keeps
                # its visible keys and no row empties
                if lo is not None:
                    j0 = max(j0, i0 + lo)
                if hi is not None:
                    j1 = min(j1, i1 + hi)
                if j0 >= j1:
                    continue
                off = j0 - i0  # slice-relative band = global band - (key start - query start)
                band = Band(None if lo is None else lo - off, None if hi is None else hi - off)
                band = band.normalized(i1 - i0, j1 - j0)
                tasks.append(Task(qo + i0 - qa, qo + i1 - qa, ko + j0 - ka, ko + j1 - ka, band.lo, band.hi))
        qo += qb - qa
    return coalesce_full(tasks)


def random_case(rng: random.Random):
    """Runs of two ranks over a sequence of random documents (with padding gaps), and a mask."""
    seq = rng.randint(20, 400)
    cuts = sorted(rng.sample(range(1, seq), rng.randint(0, min(30, seq - 1))))
    bounds = [0] + cuts + [seq]
    segs = tuple((a, b) for a, b in zip(bounds, bounds[1:]) if rng.random() >= 0.15)  # the rest: padding
    segments = None if rng.random() < 0.2 else segs
    lo = None if rng.random() < 0.6 else -rng.randint(0, 40)
    hi = rng.choice([0, 0, None, rng.randint(0, 20)])
    pieces = sorted(rng.sample(range(1, seq), rng.randint(1, min(24, seq - 1))))
    runs = list(zip([0] + pieces, pieces + [seq]))
    rng.shuffle(runs)
    cut = rng.randint(1, len(runs))
    q_runs, k_runs = runs[:cut], runs[cut:] or runs[:1]
    if rng.random() < 0.3:
        k_runs = q_runs
    return q_runs, k_runs, AttnMask(lo, hi, segments), seq


def test_same_tasks_as_walking_every_document_random():
    nonempty = 0
    for seed in range(1500):
        q_runs, k_runs, mask, seq = random_case(random.Random(seed))
        got = band_tasks(q_runs, k_runs, mask, seq)
        assert got == band_tasks_every_document(q_runs, k_runs, mask, seq), seed
        nonempty += bool(got)
    assert nonempty > 750  # (most cases had tasks to find)


DOCS = (700, 90, 1300, 33, 260, 5, 411, 77, 2048, 160, 64, 999, 3000, 12, 12, 12, 517)
DOCS = DOCS + (1024 - sum(DOCS) % 1024,)  # a length every layout below takes on 4 and 8 ranks


@pytest.mark.parametrize("layout", [dtcp.Balanced(DOCS, min_chunk=64), dtcp.Zigzag(), dtcp.Contiguous(),
                                    dtcp.Striped(128)], ids=["balanced", "zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("window", [(-1, 0), (300, 0), (-1, -1)])
def test_same_tasks_as_walking_every_document_real_layouts(layout, n, window):
    seq = sum(DOCS)
    assert seq % layout.multiple(n) == 0
    cu = [0]
    for d in DOCS:
        cu.append(cu[-1] + d)
    mask = AttnMask.make(window[1] == 0, window, tuple(zip(cu, cu[1:])))
    runs = [layout.runs(seq, n, r) for r in range(n)]
    found = 0
    for a in range(n):
        for b in range(n):
            got = band_tasks(runs[a], runs[b], mask, seq)
            assert got == band_tasks_every_document(runs[a], runs[b], mask, seq), (a, b)
            found += len(got)
    assert found >= n  # (every rank has its own tasks at least)
