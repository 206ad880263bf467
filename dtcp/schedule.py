"""Per-step ring schedule: at each step, which K/V block this rank holds and which kernel calls
it makes on it. Pure Python over integers; no process group, no tensors.

Step 0 is the rank's own block. The other steps form at most two *chains*: a left chain in which
blocks travel forward (rank r holds the block of rank r - d at its d-th step, shift +1) and a right
chain in which they travel backward (the block of rank r + d, shift -1). Without a window or
documents every block is needed and the plan is the classic ring: one left chain of N - 1 steps.
With a sliding window or document mask the plan keeps only the offsets some rank needs, and
picks the split between the two chains that sends the fewest blocks (`_choose_chains`).

For each step the schedule lists `Task`s. A task is one local kernel call:

    out[q_start:q_end] <- attention(q[q_start:q_end], k[k_start:k_end], v[k_start:k_end], band)

with the band mask written in indices relative to the two slices: key j is visible from query i
iff  lo <= j - i <= hi  (None = unbounded). Full attention is (None, None); causal attention on a
square block is (None, 0).

Every task is *trimmed*: each query row sees at least one key and each key column is seen by at
least one query. Kernels therefore never see a fully masked row (where some return lse = 0 and
others -inf), and masked-out blocks are never computed. Every causal task the core layouts emit
is square, so top-left and bottom-right aligned kernels agree on it: the schedule does not rely
on a kernel's alignment convention by accident.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .layouts import Contiguous, Layout, Striped, Zigzag


@dataclass(frozen=True)
class Task:
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
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None

    @property
    def is_square_causal(self) -> bool:
        return self.lo is None and self.hi == 0 and self.q_len == self.k_len

    def visible(self, i: int, j: int) -> bool:
        """Is key j (relative) visible from query i (relative)? For tests and docs."""
        d = j - i
        return (self.lo is None or d >= self.lo) and (self.hi is None or d <= self.hi)


@dataclass(frozen=True)
class Step:
    src: int  # the rank whose K/V block is held at this step
    tasks: tuple[Task, ...]
    # How the block got here: received from rank - shift (+1: left chain, -1: right chain,
    # 0: the local block at step 0).
    shift: int = 1


@dataclass(frozen=True)
class RingPlan:
    """The whole ring for one rank. `steps[0]` is the local block (src == rank)."""

    world_size: int
    rank: int
    local_len: int
    steps: tuple[Step, ...]

    @property
    def num_rounds(self) -> int:
        """Communication rounds of K/V: one fewer than the steps."""
        return len(self.steps) - 1

    def starts_chain(self, t: int) -> bool:
        """Does step t's block come straight from its home rank (whose sender sends its own,
        local K/V) rather than forwarded by the previous holder?"""
        return t > 0 and self.steps[t].shift != self.steps[t - 1].shift


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
        """From SDPA/flash-attn arguments: window (left, right), -1 = unbounded; causal caps
        right at 0 (flash-attn's convention: causal + window (left, -1 or 0) = (left, 0))."""
        left, right = window
        hi = None if right < 0 else right
        if is_causal:
            hi = 0 if hi is None else min(hi, 0)
        return AttnMask(None if left < 0 else -left, hi, None if segments is None else tuple(segments))

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


def ring_plan(
    layout: Layout, local_len: int, world_size: int, rank: int, is_causal: bool, mask: Optional[AttnMask] = None
) -> RingPlan:
    """This rank's plan. Plans of all ranks agree on the steps (ranks exchange in lockstep), so
    this builds every rank's tasks; use `ring_plans` when all are needed."""
    return ring_plans(layout, local_len, world_size, is_causal, mask)[rank]


def ring_plans(
    layout: Layout, local_len: int, world_size: int, is_causal: bool, mask: Optional[AttnMask] = None
) -> tuple[RingPlan, ...]:
    """Every rank's plan. `mask` (window and documents) replaces `is_causal` when given."""
    n = world_size
    if mask is None:
        mask = AttnMask.make(is_causal)
    if mask.is_plain:
        causal = mask.hi == 0

        def tasks_of(rank, src):
            return _tasks(layout, local_len, rank, src, causal)
    else:
        seq_len = local_len * n

        def tasks_of(rank, src):
            return _masked_tasks(layout, seq_len, n, rank, src, mask)

    table = {(r, d): tuple(tasks_of(r, (r - d) % n)) for r in range(n) for d in range(n)}
    needed = {d for (r, d), tasks in table.items() if d and tasks}
    left, right = _choose_chains(needed, n)
    offsets = [(0, 0)] + [(d, 1) for d in range(1, left + 1)] + [(-d, -1) for d in range(1, right + 1)]
    return tuple(
        RingPlan(n, r, local_len, tuple(Step((r - d) % n, table[r, d % n], shift) for d, shift in offsets))
        for r in range(n)
    )


def _choose_chains(needed: set[int], n: int) -> tuple[int, int]:
    """Lengths (a, b) of the left chain (offsets 1..a) and the right chain (offsets n-1..n-b, that
    is sources r+1..r+b) that cover every needed offset with the fewest rounds a + b; ties go to
    the left chain (the classic ring)."""
    best = (n - 1, 0) if needed else (0, 0)
    for a in range(n):
        rest = [d for d in needed if d > a]
        b = n - min(rest) if rest else 0
        if (a + b, b) < (sum(best), best[1]):
            best = (a, b)
    return best


def _masked_tasks(layout: Layout, seq_len: int, n: int, rank: int, src: int, mask: AttnMask) -> list[Task]:
    """Generic decomposition for windows and documents, any layout: one band task per (query
    run, document, key run) that has a visible pair, trimmed to its visible rows and columns."""
    return _band_tasks(layout.runs(seq_len, n, rank), layout.runs(seq_len, n, src), mask, seq_len)


def _band_tasks(q_run_list, k_run_list, mask: AttnMask, seq_len: int) -> list[Task]:
    """Tasks of queries held as the global runs `q_run_list` (in local order) against keys held
    as `k_run_list`: one band task per (query run, document, key run) with a visible pair. Within
    a run local order is global order, so a global band is a band in slice indices. Only key runs
    inside the document and the window's reach are looked at."""
    lo, hi = mask.lo, mask.hi
    segs = mask.segments if mask.segments is not None else ((0, seq_len),)
    seg_starts = [a for a, _ in segs]
    k_runs, ko = [], 0
    for ka, kb in k_run_list:
        k_runs.append((ka, kb, ko))
        ko += kb - ka
    k_starts = [ka for ka, _, _ in k_runs]  # runs are in increasing global order
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
                t_lo = None if lo is None or lo - off <= -(i1 - i0 - 1) else lo - off
                t_hi = None if hi is None or hi - off >= j1 - j0 - 1 else hi - off
                tasks.append(Task(qo + i0 - qa, qo + i1 - qa, ko + j0 - ka, ko + j1 - ka, t_lo, t_hi))
        qo += qb - qa
    return _coalesce_full(tasks)


def _coalesce_full(tasks: list[Task]) -> list[Task]:
    """Merge full tasks that tile a larger rectangle (fewer, larger kernel calls)."""
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


def _tasks(layout: Layout, L: int, rank: int, src: int, is_causal: bool) -> list[Task]:
    if not is_causal:
        return [Task(0, L, 0, L)]
    if src == rank:
        # Local order is global order within a rank (see layouts.py), so the local block is
        # exactly causal in local indices for every layout.
        return [Task(0, L, 0, L, None, 0)]
    if isinstance(layout, Contiguous):
        # Earlier ranks are entirely in the past, later ranks entirely in the future.
        return [Task(0, L, 0, L)] if src < rank else []
    if isinstance(layout, Zigzag):
        c = L // 2
        if src < rank:
            # Both my chunks are after the source's low chunk and before its high chunk.
            return [Task(0, L, 0, c)]
        # Only my high chunk sees the source, and it sees both of its chunks.
        return [Task(c, L, 0, L)]
    if isinstance(layout, Striped):
        b = layout.block
        if b == 1:
            if src < rank:
                return [Task(0, L, 0, L, None, 0)]  # key j is at or before query i iff j <= i
            # Strictly before: j < i. Drop query row 0 and the last key: then it is j <= i.
            return [Task(1, L, 0, L - 1, None, 0)] if L > 1 else []
        # Blocks of b tokens: query block m sees whole key blocks 0..m (src < rank) or 0..m-1.
        n = L // b
        if src < rank:
            return [Task(m * b, (m + 1) * b, 0, (m + 1) * b) for m in range(n)]
        return [Task(m * b, (m + 1) * b, 0, m * b) for m in range(1, n)]
    raise NotImplementedError(f"no ring schedule for layout {layout!r}")


# ---- the all-gather schedule ---------------------------------------------------------------------
# For short sequences a ring call is bound by host time (a few dozen tensor operations per step
# at ~10 us each), not by the GPU. There every rank gathers the whole sequence's K/V in one
# collective instead, puts it in global order, and makes one kernel call per run of its queries
# against every key that run sees: no merges, and the backward sums dK/dV in one reduce-scatter.


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


def allgather_plans(
    layout: Layout, local_len: int, world_size: int, is_causal: bool, mask: Optional[AttnMask] = None
) -> tuple[AllGatherPlan, ...]:
    """Every rank's all-gather plan. `mask` (window and documents) replaces `is_causal` when given."""
    why = allgather_reason(layout, local_len, world_size)
    if why is not None:
        raise ValueError(f"kv_exchange='allgather': {why}. Use kv_exchange='ring'")
    n, seq_len = world_size, local_len * world_size
    if mask is None:
        mask = AttnMask.make(is_causal)
    runs = [layout.runs(seq_len, n, r) for r in range(n)]
    r_count, piece_len = len(runs[0]), runs[0][0][1] - runs[0][0][0]
    starts = sorted((a, r * r_count + i) for r in range(n) for i, (a, _) in enumerate(runs[r]))
    global_order = tuple(p for _, p in starts)
    return tuple(
        AllGatherPlan(n, r, local_len, r_count, piece_len, global_order,
                      tuple(_band_tasks(runs[r], [(0, seq_len)], mask, seq_len)))
        for r in range(n)
    )


KV_EXCHANGES = ("auto", "ring", "allgather")
# `auto` gathers when the whole sequence's K/V is at most this many bytes (per rank, after the
# gather): there a ring call is bound by host time. Measured on 2 H200s (docs/performance.md,
# "The all-gather schedule"): the all-gather was ahead of the ring at 16 MiB, even or behind at
# 32 MiB and behind at 64 MiB.
ALLGATHER_AUTO_MAX_BYTES = 16 * 2**20


def check_kv_exchange(value: str) -> None:
    if value not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}; got {value!r}")


def choose_kv_exchange(
    requested: str, layout: Layout, local_len: int, world_size: int, device_type: str, gathered_kv_bytes: int
) -> str:
    """"ring" or "allgather" for a call. `auto` picks the all-gather on CUDA for one-or-two-run
    layouts (contiguous, zigzag) when the gathered K/V is small (ALLGATHER_AUTO_MAX_BYTES), and
    the ring otherwise (and always on CPU, where it was not measured to be faster)."""
    check_kv_exchange(requested)
    if requested != "auto":
        return requested
    if (device_type == "cuda" and world_size > 1 and gathered_kv_bytes <= ALLGATHER_AUTO_MAX_BYTES
            and allgather_reason(layout, local_len, world_size) is None):
        return "allgather"
    return "ring"


# ---- one variable-length kernel call for a whole batch ---------------------------------------------
# Under a document mask the all-gather plan has one task per (run of queries, document): dozens of
# small kernel calls per batch row, each costing host time. A varlen kernel (flash-attn's
# cu_seqlens convention) takes them all at once: every (row, task) pair is one sequence of the
# call, and rows may have their own documents.


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
    def rows_tiled(self) -> bool:
        """Does every local query row of every batch row belong to exactly one sequence, in
        order (so the packed queries are the local rows as they are)?"""
        return all(p.rows_tiled for p in set(self.rows))


def varlen_window(mask: AttnMask) -> tuple[int, int]:
    """The mask's band as a bottom-right aligned (left, right) window, -1 = unbounded."""
    return (-1 if mask.lo is None else -mask.lo, -1 if mask.hi is None else mask.hi)


def _normalized_band(q_len: int, k_len: int, lo: Optional[int], hi: Optional[int]):
    # Bounds that cannot bind on a q_len x k_len block are the same as no bound.
    if lo is not None and lo <= -(q_len - 1):
        lo = None
    if hi is not None and hi >= k_len - 1:
        hi = None
    return lo, hi


def varlen_reason(tasks, window: tuple[int, int]) -> Optional[str]:
    """Why one bottom-right aligned `window` does not give every task exactly its band (so the
    tasks cannot be one varlen call), or None."""
    left, right = window
    for t in tasks:
        shift = t.k_len - t.q_len  # bottom-right: query i lines up with key i + shift
        lo = None if left < 0 else shift - left
        hi = None if right < 0 else shift + right
        if right >= t.k_len and hi is not None and hi < t.k_len - 1:
            # FlashAttention-2 reads window_size_right >= seqlen_k as unbounded (kernels.py)
            return f"window {window} would be read as unbounded on a {t.q_len}x{t.k_len} sequence"
        if _normalized_band(t.q_len, t.k_len, lo, hi) != _normalized_band(t.q_len, t.k_len, t.lo, t.hi):
            return (f"the task {t} has band ({t.lo}, {t.hi}), which the bottom-right window {window} "
                    f"does not give on a {t.q_len}x{t.k_len} sequence")
    return None
