"""Masks in index form: the band, the task, and the whole-sequence mask.

A *band* says which keys a query sees by their offset: key j is visible from query i iff
lo <= j - i <= hi (None = unbounded). Full attention is (None, None); causal attention on a
square block is (None, 0). Kernels speak flash-attn's *window* instead: (left, right), -1 =
unbounded, aligned at the bottom-right corner of a q_len x k_len block (query i lines up with key
i + k_len - q_len). `Band` converts between the two, in one place.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Optional


@dataclass(frozen=True)
class Band:
    """Key j visible from query i iff lo <= j - i <= hi (None = unbounded)."""

    lo: Optional[int] = None
    hi: Optional[int] = None

    @staticmethod
    def from_window(window: tuple[int, int], is_causal: bool = False) -> "Band":
        """The band of a whole-sequence flash-attn window (left, right), -1 = unbounded; causal caps
        the right side at 0 (flash-attn's convention: causal + window (left, -1 or 0) = (left, 0))."""
        left, right = window
        hi = None if right < 0 else right
        if is_causal:
            hi = 0 if hi is None else min(hi, 0)
        return Band(None if left < 0 else -left, hi)

    @property
    def window(self) -> tuple[int, int]:
        """Inverse of from_window: (left, right), -1 = unbounded."""
        return (-1 if self.lo is None else -self.lo, -1 if self.hi is None else self.hi)

    @property
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None

    @staticmethod
    def from_aligned_window(q_len: int, k_len: int, window: tuple[int, int]) -> "Band":
        """The band that a bottom-right aligned window gives on a q_len x k_len block."""
        left, right = window
        shift = k_len - q_len
        return Band(None if left < 0 else shift - left, None if right < 0 else shift + right)

    def aligned_window(self, q_len: int, k_len: int) -> tuple[int, int]:
        """The bottom-right aligned window (left, right) that gives this band on a q_len x k_len
        block; -1 = unbounded. A negative bound other than -1 means no such window exists."""
        shift = k_len - q_len
        return (-1 if self.lo is None else shift - self.lo, -1 if self.hi is None else self.hi - shift)

    def normalized(self, q_len: int, k_len: int) -> "Band":
        """The same visibility on a q_len x k_len block, with bounds that cannot bind dropped."""
        lo = None if self.lo is not None and self.lo <= -(q_len - 1) else self.lo
        hi = None if self.hi is not None and self.hi >= k_len - 1 else self.hi
        return Band(lo, hi)


@dataclass(frozen=True)
class Task:
    """One local kernel call: out[q_start:q_end] <- attention(q[q_start:q_end], k[k_start:k_end],
    v[k_start:k_end]) under band (lo, hi), in indices relative to the two slices."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    lo: Optional[int] = None
    hi: Optional[int] = None

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def k_len(self) -> int:
        return self.k_end - self.k_start

    @property
    def band(self) -> Band:
        return Band(self.lo, self.hi)

    @property
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None

    @property
    def is_square_causal(self) -> bool:
        return self.lo is None and self.hi == 0 and self.q_len == self.k_len

    @property
    def is_bottom_right_causal(self) -> bool:
        """Causal aligned at the last key: key j visible from query i iff j - i <= k_len - q_len."""
        return self.lo is None and self.hi == self.k_len - self.q_len

    def visible(self, i: int, j: int) -> bool:
        """Is key j (relative) visible from query i (relative)? For tests and docs."""
        d = j - i
        return (self.lo is None or d >= self.lo) and (self.hi is None or d <= self.hi)


@dataclass(frozen=True)
class AttnMask:
    """Which keys a query sees, in global token positions.

    Key j is visible from query i iff `lo <= j - i <= hi` (None = unbounded) and i and j lie in
    the same segment. `segments` are sorted, disjoint [start, end) ranges (documents); a token in
    no segment is padding: it sees nothing and nobody sees it. segments=None: one document."""

    lo: Optional[int] = None
    hi: Optional[int] = None
    segments: Optional[tuple[tuple[int, int], ...]] = None

    @staticmethod
    def make(is_causal: bool, window: tuple[int, int] = (-1, -1), segments=None) -> "AttnMask":
        """From SDPA/flash-attn arguments (see Band.from_window)."""
        band = Band.from_window(window, is_causal)
        return AttnMask(band.lo, band.hi, None if segments is None else tuple(segments))

    @property
    def band(self) -> Band:
        return Band(self.lo, self.hi)

    @cached_property
    def segment_starts(self) -> Optional[list[int]]:
        """The documents' starts, for bisection (once per mask: every rank pair's plan reads them)."""
        return None if self.segments is None else [a for a, _ in self.segments]

    @property
    def is_plain(self) -> bool:
        """No window and no documents: full or causal attention."""
        return self.lo is None and self.segments is None and self.hi in (None, 0)

    def visible(self, i: int, j: int) -> bool:
        d = j - i
        if (self.lo is not None and d < self.lo) or (self.hi is not None and d > self.hi):
            return False
        if self.segments is None:
            return True
        k = bisect.bisect_right(self.segments, (i, float("inf"))) - 1
        return k >= 0 and self.segments[k][0] <= min(i, j) and max(i, j) < self.segments[k][1]


def union_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Half-open (lo, hi) ranges as sorted, disjoint ones (overlapping or touching ranges joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def documents_reached(runs, seg_starts) -> set[int]:
    """The indices of the documents (starting at `seg_starts`, sorted) that global runs [a, b)
    reach: every one they touch, and at most one more (a run starting between documents counts
    the one before), never fewer."""
    return {d for a, b in runs
            for d in range(max(bisect.bisect_right(seg_starts, a) - 1, 0), bisect.bisect_left(seg_starts, b))}


def band_tasks(q_run_list, k_run_list, mask: AttnMask, seq_len: int, k_documents=None) -> list[Task]:
    """Tasks of queries held as the global runs `q_run_list` (in local order) against keys held as
    `k_run_list` (both in local order, which need not be global order): one band task per (query
    run, document, key run) with a visible pair, trimmed to its visible rows and columns. Within a
    run local order is global order, so a global band is a band in slice indices. Only key runs inside the document and the window's reach are looked
    at. Every task is trimmed: each query row sees at least one key and each key column is seen
    by at least one query, so kernels never see a fully masked row. `k_documents`: what
    `documents_reached` gives for `k_run_list` under the mask's documents, where the caller has it
    already (ring_plans: once per rank, not once per rank pair)."""
    lo, hi = mask.lo, mask.hi
    segs = mask.segments if mask.segments is not None else ((0, seq_len),)
    seg_starts = mask.segment_starts if mask.segments is not None else [0]
    k_runs, ko = [], 0
    for ka, kb in k_run_list:
        k_runs.append((ka, kb, ko))
        ko += kb - ka
    # Searched in global order (a layout may hold its runs in another local order: Balanced puts
    # the runs it shares with other ranks first); `ko` keeps each run's local offset.
    k_runs.sort()
    k_starts = [ka for ka, _, _ in k_runs]
    # The documents some key run reaches, in order: only they can give a query run tasks. A rank's
    # query runs span most of a batch's documents, another rank's key runs reach few of them (the
    # documents cut over both), and every rank plans every rank's steps once per new batch.
    if k_documents is None:
        k_documents = documents_reached(((ka, kb) for ka, kb, _ in k_runs), seg_starts)
    reached = sorted(k_documents)
    tasks = []
    qo = 0
    for qa, qb in q_run_list:
        first_doc = max(bisect.bisect_right(seg_starts, qa) - 1, 0)
        for d in reached[bisect.bisect_left(reached, first_doc):]:
            ds, de = segs[d]
            if ds >= qb:
                break
            # keys this document and the band allow for these queries
            key_lo = max(ds, qa + lo) if lo is not None else ds
            key_hi = min(de, qb + hi) if hi is not None else de
            for r in range(max(bisect.bisect_right(k_starts, key_lo) - 1, 0), len(k_runs)):
                ka, kb, ko = k_runs[r]
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


def coalesce_full(tasks: list[Task]) -> list[Task]:
    """Merge full tasks that tile a larger rectangle (fewer, larger kernel calls), sorted by
    (q_start, k_start). The merges: repeatedly, the first full task in list order (a merged task
    joins the end of the list) that has a full task right below it (the same keys, its rows
    continuing) or right beside it (the same rows, its keys continuing) absorbs the earlier of
    those two.

    Tasks of one step are disjoint (no (query, key) pair in two), so each task has at most one
    neighbour below and one beside, found by its edges in dicts, and a heap of list positions
    gives the first task with a neighbour: O(n log n). (A DocZigzag step holds thousands of full
    tasks: rescanning every pair after each merge took 1.5 s to plan one 128K-token batch of 172
    documents at N = 8, paid again for every batch with new documents.)"""
    alive: dict[int, Task] = {}  # list position -> full task; a merged task is placed past the end
    top, left, bottom, right = {}, {}, {}, {}  # an edge -> the position of the full task on it

    def edges(t: Task):
        return ((top, (t.k_start, t.k_end, t.q_start)), (left, (t.q_start, t.q_end, t.k_start)),
                (bottom, (t.k_start, t.k_end, t.q_end)), (right, (t.q_start, t.q_end, t.k_end)))

    def add(t: Task, position: int) -> None:
        for where, edge in edges(t):
            if edge in where:  # two tasks on one edge overlap: not the tasks of one step
                raise AssertionError(f"dtcp bug: coalesce_full got overlapping full tasks ({t})")
            where[edge] = position
        alive[position] = t

    def remove(position: int) -> None:
        for where, edge in edges(alive.pop(position)):
            del where[edge]

    def neighbour(position: int) -> Optional[int]:
        """The position of the earlier of the task's full neighbours below and beside, or None."""
        t = alive[position]
        found = [p for p in (top.get((t.k_start, t.k_end, t.q_end)), left.get((t.q_start, t.q_end, t.k_end)))
                 if p is not None]
        return min(found) if found else None

    for i, t in enumerate(tasks):
        if t.is_full:
            add(t, i)
    # every task that has a neighbour is in the heap (and some that no longer have one)
    heap = [i for i in alive if neighbour(i) is not None]
    heapq.heapify(heap)
    end = len(tasks)
    while heap:
        i = heapq.heappop(heap)
        j = neighbour(i) if i in alive else None
        if j is None:
            continue  # merged away, or its neighbours were
        a, b = alive[i], alive[j]
        m = Task(a.q_start, b.q_end, a.k_start, a.k_end) if a.k_end == b.k_end else \
            Task(a.q_start, a.q_end, a.k_start, b.k_end)
        remove(i)
        remove(j)
        add(m, end)
        # the tasks that m gives a neighbour: the one right above it, the one left of it, and m
        for p in (bottom.get((m.k_start, m.k_end, m.q_start)), right.get((m.q_start, m.q_end, m.k_start)), end):
            if p is not None and neighbour(p) is not None:
                heapq.heappush(heap, p)
        end += 1
    return sorted([t for t in tasks if not t.is_full] + list(alive.values()), key=lambda t: (t.q_start, t.k_start))
