"""The all-gather schedule: every rank gathers the whole sequence's K/V in one collective and makes
one kernel call per run of its queries against every key that run sees. No merges (each query row
is computed by exactly one call) and, in the backward, one reduce-scatter of dK/dV.

For short sequences a ring call is bound by host time (a few dozen tensor operations per step),
not by the GPU; this schedule has a handful of operations per call. `VarlenPlan` goes further for
documents: every (batch row, task) pair becomes one sequence of a single varlen kernel call.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional, Sequence

from ..layouts import Layout
from .mask import AttnMask, Band, Task, band_tasks, union_ranges


@dataclass(frozen=True)
class AllGatherPlan:
    """One rank's all-gather schedule.

    `pieces` is the whole sequence in token order as slices of the ranks' shards: piece
    (rank, lo, hi) is tokens lo:hi of that rank's shard, and the pieces follow each other in the
    sequence (maximal: neighbours of one rank that touch in both orders are one piece). Any layout
    has them; contiguous and zigzag have one or two equal pieces per rank, Balanced and DocZigzag
    many of different lengths.

    `tasks` are kernel calls with query indices local (into this rank's shard) and key indices
    global (into the whole sequence in order); their query ranges are disjoint and sorted, so
    no row is computed twice and no merge is needed. Rows in no task see no key (padding under a
    document mask)."""

    world_size: int
    rank: int
    local_len: int
    pieces: tuple[tuple[int, int, int], ...]
    tasks: tuple[Task, ...]

    @property
    def seq_len(self) -> int:
        return self.local_len * self.world_size

    @property
    def rows_tiled(self) -> bool:
        """Do the tasks' query ranges cover [0, local_len) without a gap (outputs concatenate)?"""
        end = 0
        for t in self.tasks:
            if t.q_start != end:
                return False
            end = t.q_end
        return end == self.local_len

    @cached_property
    def _piece_starts(self) -> tuple[int, ...]:
        starts, g = [], 0
        for _, lo, hi in self.pieces:
            starts.append(g)
            g += hi - lo
        return tuple(starts)

    @cached_property
    def key_writes(self) -> tuple[tuple[tuple[tuple[int, int, bool], ...], ...], tuple[tuple[int, int], ...]]:
        """How the backward sums the tasks' dK/dV over the global keys without a zero fill: per
        task, its keys [k_start, k_end) as runs (start, end, first), in order, `first` where no
        earlier task has keys there (the run is copied in: 0 + x is x, the same bits as a zeroed
        sum), else added; and the key ranges no task sees (zeroed). Global key indices."""
        covered: list[list[int]] = []  # sorted, disjoint, maximal
        per_task = []
        for t in self.tasks:
            a, c = t.k_start, t.k_end
            runs, pos = [], a
            for x, y in covered if a < c else ():
                if y <= pos:
                    continue
                if x >= c:
                    break
                if x > pos:
                    runs.append((pos, x, True))
                    pos = x
                end = min(y, c)
                runs.append((pos, end, False))
                pos = end
                if pos >= c:
                    break
            if pos < c:
                runs.append((pos, c, True))
            per_task.append(tuple(runs))
            if a < c:
                merged = []
                for x, y in sorted(covered + [[a, c]]):
                    if merged and x <= merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], y)
                    else:
                        merged.append([x, y])
                covered = merged
        uncovered, pos = [], 0
        for x, y in covered:
            if x > pos:
                uncovered.append((pos, x))
            pos = y
        if pos < self.seq_len:
            uncovered.append((pos, self.seq_len))
        return tuple(per_task), tuple(uncovered)

    def key_slices(self, k_start: int, k_end: int) -> tuple[tuple[int, int, int], ...]:
        """Global keys [k_start, k_end) as (rank, lo, hi) slices of the ranks' own shards, in
        global order (neighbouring slices of one rank that touch are one)."""
        starts = self._piece_starts
        out = []
        for i in range(max(0, bisect.bisect_right(starts, k_start) - 1), len(starts)):
            g0 = starts[i]
            if g0 >= k_end:
                break
            rank, lo, hi = self.pieces[i]
            a, b = max(k_start, g0), min(k_end, g0 + hi - lo)
            if a < b:
                out.append((rank, lo + a - g0, lo + b - g0))
        return tuple(out)


def sequence_pieces(layout: Layout, local_len: int, world_size: int) -> tuple[tuple[int, int, int], ...]:
    """The sequence in token order as (rank, lo, hi) slices of the ranks' shards (AllGatherPlan.pieces)."""
    seq_len = local_len * world_size
    found = []
    for r in range(world_size):
        pos = 0
        for a, b in layout.runs(seq_len, world_size, r):
            found.append((a, r, pos, pos + b - a))
            pos += b - a
    found.sort()
    pieces: list[list[int]] = []
    for _, r, lo, hi in found:
        if pieces and pieces[-1][0] == r and pieces[-1][2] == lo:
            pieces[-1][2] = hi
        else:
            pieces.append([r, lo, hi])
    return tuple(tuple(p) for p in pieces)


#: runs per rank the all-gather's per-task form serves (one kernel call per run): contiguous, zigzag
ALLGATHER_MAX_RUNS = 2


@lru_cache(maxsize=256)
def allgather_reason(layout: Layout, local_len: int, world_size: int, one_launch: bool = False) -> Optional[str]:
    """Why the all-gather schedule cannot serve this layout, or None. `one_launch`: every task
    runs in one varlen kernel call (documents, and a kernel with a one-launch varlen form), which
    serves any layout; otherwise the schedule makes one kernel call per run and takes layouts
    whose ranks hold the same few equal runs."""
    if one_launch:
        return None
    seq_len = local_len * world_size
    runs = [layout.runs(seq_len, world_size, r) for r in range(world_size)]
    counts = {len(rr) for rr in runs}
    lens = {b - a for rr in runs for a, b in rr}
    if len(counts) != 1 or len(lens) != 1:
        return (f"{layout!r} gives ranks runs of unequal lengths, which the all-gather serves only as one varlen "
                "launch: with documents (cu_seqlens) and a kernel that takes them in one launch (fa4, flash)")
    if counts.pop() > ALLGATHER_MAX_RUNS:
        return (f"{layout!r} holds {len(runs[0])} separate runs of tokens per rank here, and the "
                f"all-gather schedule makes one kernel call per run (it serves at most "
                f"{ALLGATHER_MAX_RUNS}: the contiguous and zigzag layouts) unless the call has documents and a "
                "kernel that takes them in one varlen launch (fa4, flash)")
    return None


@lru_cache(maxsize=256)
def allgather_plans(layout: Layout, local_len: int, world_size: int, is_causal: bool,
                    mask: Optional[AttnMask] = None) -> tuple[AllGatherPlan, ...]:
    """Every rank's all-gather plan, for any layout (whether a kernel can run it is
    `allgather_reason`'s and the route's question). `mask` (window and documents) replaces
    `is_causal` when given."""
    n, seq_len = world_size, local_len * world_size
    if mask is None:
        mask = AttnMask.make(is_causal)
    pieces = sequence_pieces(layout, local_len, n)
    return tuple(
        AllGatherPlan(n, r, local_len, pieces, tuple(band_tasks(layout.runs(seq_len, n, r), [(0, seq_len)], mask, seq_len)))
        for r in range(n)
    )


@dataclass(frozen=True)
class VarlenPlan:
    """Every batch row's all-gather plan as one varlen kernel call.

    `rows[b]` is row b's AllGatherPlan (the same object for rows that share a mask). Sequence i of
    the call is task t of row b, in row order then task order: its queries are rows
    q_start:q_end of batch row b (local), its keys k_start:k_end of row b's gathered K/V (global).
    The kernel applies one bottom-right aligned window `window` = (left, right) to every sequence
    (flash-attn's convention, -1 = unbounded; (-1, 0) is causal); `varlen_reason` has checked that
    it gives each task exactly the task's band."""

    rows: tuple[AllGatherPlan, ...]
    window: tuple[int, int]
    # The keys this rank fetches and serves, where the call moves only the keys other ranks read
    # (`varlen_plans`); None: every rank's whole shard is gathered.
    exchange: Optional["KeyExchange"] = None

    @property
    def world_size(self) -> int:
        return self.rows[0].world_size

    @property
    def rank(self) -> int:
        return self.rows[0].rank

    @property
    def local_len(self) -> int:
        return self.rows[0].local_len

    @property
    def seq_len(self) -> int:
        return self.rows[0].seq_len

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(t for row in self.rows for t in row.tasks)

    @property
    def rows_tiled(self) -> bool:
        """Does every local query row of every batch row belong to exactly one sequence, in
        order (so the packed queries are the local rows as they are)?"""
        return all(p.rows_tiled for p in set(self.rows))

    @property
    def seq_lens(self) -> tuple[tuple[int, int], ...]:
        """(q_len, k_len) of every sequence of the call, in order."""
        return tuple((t.q_len, t.k_len) for t in self.tasks)


def varlen_reason(tasks, window: tuple[int, int]) -> Optional[str]:
    """Why one bottom-right aligned `window` does not give every task exactly its band (so the
    tasks cannot be one varlen call), or None."""
    for t in tasks:
        got = Band.from_aligned_window(t.q_len, t.k_len, window).normalized(t.q_len, t.k_len)
        if got != t.band.normalized(t.q_len, t.k_len):
            return (f"the task {t} has band ({t.lo}, {t.hi}), which the bottom-right window {window} "
                    f"does not give on a {t.q_len}x{t.k_len} sequence")
    return None


Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class KeyExchange:
    """The keys one rank's varlen call moves: only those that some other rank's sequences read,
    where the plain all-gather moves every rank's whole shard to every rank. With packed documents
    most documents sit whole on one rank, and their keys never need to leave it.

    Rows are a rank's flat token rows, b * L + i for token i of batch row b (L local tokens), as
    sorted disjoint (lo, hi) ranges.
        fetch[i]: rank i's rows this rank reads (empty for itself): what it receives from i.
        serve[j]: this rank's rows rank j reads (empty for itself): what it sends to j, and the
                  rows whose dK/dV shares come back from j in the backward.
        moves:    whether any rank of the group moves any row (the same on every rank: where
                  none does, no rank calls the collective)."""

    fetch: tuple[Ranges, ...]
    serve: tuple[Ranges, ...]
    moves: bool

    @property
    def fetched_rows(self) -> int:
        return sum(hi - lo for ranges in self.fetch for lo, hi in ranges)

    @property
    def served_rows(self) -> int:
        return sum(hi - lo for ranges in self.serve for lo, hi in ranges)


def varlen_plans(rank_rows: Sequence[tuple[AllGatherPlan, ...]], window: tuple[int, int]) -> list[VarlenPlan]:
    """Every rank's VarlenPlan (rank_rows[r]: rank r's plan per batch row), each with its
    KeyExchange, derived from every rank's tasks: pure arithmetic, the same on every rank."""
    n = len(rank_rows)
    reads = [[[] for _ in range(n)] for _ in range(n)]  # reads[me][owner]: owner's row ranges
    for me, rows in enumerate(rank_rows):
        for b, row in enumerate(rows):
            offset = b * row.local_len
            for t in row.tasks:
                for owner, lo, hi in row.key_slices(t.k_start, t.k_end):
                    if owner != me:
                        reads[me][owner].append((offset + lo, offset + hi))
    fetch = [[union_ranges(reads[me][owner]) for owner in range(n)] for me in range(n)]
    moves = any(ranges for per_rank in fetch for ranges in per_rank)
    return [VarlenPlan(tuple(rows), window, KeyExchange(tuple(fetch[me]), tuple(fetch[j][me] for j in range(n)), moves))
            for me, rows in enumerate(rank_rows)]
