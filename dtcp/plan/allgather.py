"""The all-gather schedule: every rank gathers the whole sequence's K/V in one collective and makes
one kernel call per run of its queries against every key that run sees. No merges (each query row
is computed by exactly one call) and, in the backward, one reduce-scatter of dK/dV.

For short sequences a ring call is bound by host time (a few dozen tensor operations per step),
not by the GPU; this schedule has a handful of operations per call. `VarlenPlan` goes further for
documents: every (batch row, task) pair becomes one sequence of a single varlen kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..layouts import Layout
from .mask import AttnMask, Band, Task, band_tasks


@dataclass(frozen=True)
class AllGatherPlan:
    """One rank's all-gather schedule.

    Every rank holds `runs_per_rank` runs of `piece_len` tokens (layout.runs). The gathered
    buffer holds the pieces rank-major: piece p is run p % R of rank p // R. `global_order[j]` is
    the piece at global position j (global tokens [j*P, (j+1)*P)).

    `tasks` are kernel calls with query indices local (into this rank's shard) and key indices
    global (into the whole sequence in order); their query ranges are disjoint and sorted, so
    no row is computed twice and no merge is needed. Rows in no task see no key (padding under a
    document mask)."""

    world_size: int
    rank: int
    local_len: int
    runs_per_rank: int
    piece_len: int
    global_order: tuple[int, ...]
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

    @property
    def rank_major_positions(self) -> tuple[int, ...]:
        """For each piece p in rank-major order, its global position (inverse of global_order)."""
        pos = [0] * len(self.global_order)
        for j, p in enumerate(self.global_order):
            pos[p] = j
        return tuple(pos)

    def key_slices(self, k_start: int, k_end: int) -> tuple[tuple[int, int, int], ...]:
        """Global keys [k_start, k_end) as (rank, lo, hi) slices of the ranks' own shards, in
        global order; neighbouring slices of one rank that touch are merged."""
        p_len, r_count = self.piece_len, self.runs_per_rank
        out: list[list[int]] = []
        for j in range(k_start // p_len, -(-k_end // p_len)):
            p = self.global_order[j]
            g0, g1 = max(k_start, j * p_len), min(k_end, (j + 1) * p_len)
            rank, lo = p // r_count, (p % r_count) * p_len + g0 - j * p_len
            if out and out[-1][0] == rank and out[-1][2] == lo:
                out[-1][2] = lo + g1 - g0
            else:
                out.append([rank, lo, lo + g1 - g0])
        return tuple(tuple(x) for x in out)


ALLGATHER_MAX_RUNS = 2


@lru_cache(maxsize=256)
def allgather_reason(layout: Layout, local_len: int, world_size: int) -> Optional[str]:
    """Why the all-gather schedule cannot serve this layout, or None."""
    seq_len = local_len * world_size
    runs = [layout.runs(seq_len, world_size, r) for r in range(world_size)]
    counts = {len(rr) for rr in runs}
    lens = {b - a for rr in runs for a, b in rr}
    if len(counts) != 1 or len(lens) != 1:
        return f"{layout!r} gives ranks runs of unequal lengths"
    if counts.pop() > ALLGATHER_MAX_RUNS:
        return (f"{layout!r} holds {len(runs[0])} separate runs of tokens per rank here, and the "
                f"all-gather schedule makes one kernel call per run (it serves at most "
                f"{ALLGATHER_MAX_RUNS}: the contiguous and zigzag layouts)")
    return None


@lru_cache(maxsize=256)
def allgather_plans(layout: Layout, local_len: int, world_size: int, is_causal: bool,
                    mask: Optional[AttnMask] = None) -> tuple[AllGatherPlan, ...]:
    """Every rank's all-gather plan. `mask` (window and documents) replaces `is_causal` when given."""
    why = allgather_reason(layout, local_len, world_size)
    if why is not None:
        raise ValueError(f"strategy='allgather': {why}. Use strategy='ring' (or 'auto')")
    n, seq_len = world_size, local_len * world_size
    if mask is None:
        mask = AttnMask.make(is_causal)
    runs = [layout.runs(seq_len, n, r) for r in range(n)]
    r_count, piece_len = len(runs[0]), runs[0][0][1] - runs[0][0][0]
    starts = sorted((a, r * r_count + i) for r in range(n) for i, (a, _) in enumerate(runs[r]))
    global_order = tuple(p for _, p in starts)
    return tuple(
        AllGatherPlan(n, r, local_len, r_count, piece_len, global_order,
                      tuple(band_tasks(runs[r], [(0, seq_len)], mask, seq_len)))
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
