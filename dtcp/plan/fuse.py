"""One launch per step: a ring step's tasks as few varlen kernel calls.

A step of a document, striped or balanced plan holds many small tasks (one per query run,
document and key run). Kernels with a one-launch varlen form (FlashAttention-4, flash) take
them together: each task is one *sequence* of the call (its query rows, its keys), and a call
has one bottom-right aligned window for all its sequences. So:

1. Tasks on the same query rows whose keys are adjacent merge when their union is one band: a
   fully visible run of earlier keys followed by a causal block is one bottom-right causal
   sequence (query i sees every earlier key and the diagonal). Under a causal document mask
   every query run then has one sequence per step: bottom-right causal at the local step, full
   at the others. Then tasks stacked on adjacent query rows over the same first key merge when
   one band gives both: a document cut in two chunks that a rank holds side by side (Balanced,
   DocZigzag) is a causal block over the first chunk above a bottom-right causal block over
   both, that is one causal sequence over both. The local step's launch then takes the rank's
   keys as one view, with no gather of K/V and no scattered dK/dV adds.
2. Sequences group by their aligned window; each group is one launch, split further only where
   two sequences would share query rows (a launch's rows are disjoint, so its output lands on
   the accumulators without a merge of its own).

Pure Python over the plan's integers; executors (dtcp/exec/ring.py) gather the rows and keys.
`fused_launches` decides whether a plan runs so (exec/fused.py runs it; exec/route.py counts its
launches for the cost model, dtcp/plan/cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import bisect

from .mask import Band, Task, coalesce_full
from .ring import _hull


@dataclass(frozen=True)
class Launch:
    """One varlen call: sequence i is rows `q_ranges[i]` of the rank's queries against keys
    `k_ranges[i]` of the held block (indices as in Task), all under one bottom-right window
    (left, right), -1 = unbounded. Query ranges are disjoint and sorted."""

    window: tuple[int, int]
    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]

    @cached_property
    def cu_q(self) -> tuple[int, ...]:
        return _cumulative(self.q_ranges)

    @cached_property
    def cu_k(self) -> tuple[int, ...]:
        return _cumulative(self.k_ranges)

    @property
    def seq_lens(self) -> list[tuple[int, int]]:
        return [(qb - qa, kb - ka) for (qa, qb), (ka, kb) in zip(self.q_ranges, self.k_ranges)]

    @cached_property
    def q_span(self):
        """(start, end) when the query ranges tile [start, end) in order (a view, no gather), else None."""
        return _tiling(self.q_ranges)

    @cached_property
    def k_span(self):
        """(start, end) when the key ranges tile [start, end) in order, else None."""
        return _tiling(self.k_ranges)

    @cached_property
    def q_in_order(self) -> bool:
        """Do the query ranges lie apart in increasing order (a kernel with varlen gaps reads them
        in place: one window, the rows between left out)?"""
        return _in_order(self.q_ranges)

    @cached_property
    def k_in_order(self) -> bool:
        return _in_order(self.k_ranges)

    @cached_property
    def keys_disjoint(self) -> bool:
        ranges = sorted(self.k_ranges)
        return all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))

    @property
    def pairs(self) -> int:
        """(query, key) pairs the launch computes (its tasks' visible pairs)."""
        return sum(_band_pairs(ql, kl, Band.from_aligned_window(ql, kl, self.window)) for ql, kl in self.seq_lens)


def _cumulative(ranges) -> tuple[int, ...]:
    out = [0]
    for a, b in ranges:
        out.append(out[-1] + b - a)
    return tuple(out)


def _in_order(ranges) -> bool:
    return all(x[1] <= y[0] for x, y in zip(ranges, ranges[1:]))


def _tiling(ranges):
    if all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])):
        return (ranges[0][0], ranges[-1][1])
    return None


def _band_pairs(q_len: int, k_len: int, band: Band) -> int:
    total = 0
    for i in range(q_len):
        lo = 0 if band.lo is None else max(0, i + band.lo)
        hi = k_len - 1 if band.hi is None else min(k_len - 1, i + band.hi)
        total += max(0, hi - lo + 1)
    return total


def merge_adjacent(a: Task, b: Task):
    """The one task equal to a and b together (same rows, b's keys right after a's), or None.

    Row i sees a's keys [i + a.lo, a.k_len) (a has no right bound) and b's keys [0, i + b.hi]
    (b has no left bound). Their union is the band (a.lo, a.k_len + b.hi) on the joined keys
    when no row sees b without all of a's tail and no row sees a's tail without b's head: b.hi
    >= -1 (row 0 sees b from its first key or not at all, then the band ends at a's last key)
    and a.lo <= a.k_len - q_len + 1 (the last row still reaches a's last key)."""
    if (a.q_start, a.q_end) != (b.q_start, b.q_end) or a.k_end != b.k_start:
        return None
    if a.hi is not None or b.lo is not None:
        return None
    if b.hi is not None and b.hi < -1:
        return None
    if a.lo is not None and a.lo > a.k_len - a.q_len + 1:
        return None
    hi = None if b.hi is None else b.hi + a.k_len
    band = Band(a.lo, hi).normalized(a.q_len, a.k_len + b.k_len)
    return Task(a.q_start, a.q_end, a.k_start, b.k_end, band.lo, band.hi)


def _visible_interval(i: int, band: Band, k_len: int) -> tuple[int, int]:
    """Row i's visible keys [first, last] (clipped to [0, k_len - 1]; first > last: none)."""
    first = 0 if band.lo is None else max(0, i + band.lo)
    last = k_len - 1 if band.hi is None else min(k_len - 1, i + band.hi)
    return first, last


def _kinks(band: Band, k_len: int) -> list[int]:
    """Rows where _visible_interval changes slope (each bound is linear in i on either side)."""
    out = []
    if band.lo is not None:
        out.append(-band.lo)
    if band.hi is not None:
        out.append(k_len - 1 - band.hi)
    return out


def merge_stacked(a: Task, b: Task):
    """The one task equal to a and b together when b's rows follow a's and both start at the
    same key (a's keys a prefix of b's), or None.

    The joined task is b's band on rows [a.q_start, b.q_end) x keys [b.k_start, b.k_end), its
    offsets shifted by a's rows: b's rows see in it exactly what they saw. a's rows must too:
    both visible-key bounds are piecewise linear in the row with slopes 0 or 1, so they agree
    on every row of a when they agree at a's first and last rows and at every kink."""
    if a.q_end != b.q_start or a.k_start != b.k_start or a.k_end > b.k_end:
        return None
    # b's band as given, or with an unbounded side written as the tightest bound that keeps b's
    # rows as they are (a one-row full block is also causal: it sees up to its last key)
    his = {b.hi, b.k_len - 1 if b.hi is None else b.hi}
    los = {b.lo, -(b.q_len - 1) if b.lo is None else b.lo}
    for lo in sorted(los, key=lambda x: x is not None):
        for hi in sorted(his, key=lambda x: x is not None):
            joined = _stacked(a, b, lo, hi)
            if joined is not None:
                return joined
    return None


def _stacked(a: Task, b: Task, lo, hi):
    shift = a.q_len
    band = Band(None if lo is None else lo - shift, None if hi is None else hi - shift)
    band = band.normalized(a.q_len + b.q_len, b.k_len)
    joined = Task(a.q_start, b.q_end, b.k_start, b.k_end, band.lo, band.hi)
    if min(band.aligned_window(joined.q_len, joined.k_len)) < -1:
        return None  # no bottom-right window gives it: keep two sequences
    rows = {0, a.q_len - 1, *_kinks(a.band, a.k_len), *_kinks(band, joined.k_len)}
    for i in rows:
        if 0 <= i < a.q_len and _visible_interval(i, a.band, a.k_len) != _visible_interval(i, band, joined.k_len):
            return None
    return joined


def stack_rows(tasks) -> list[Task]:
    """Merge tasks stacked on adjacent query rows (merge_stacked), repeatedly, top to bottom."""
    by_start: dict = {}
    for t in tasks:
        by_start.setdefault((t.q_start, t.k_start), []).append(t)
    out = []
    for t in sorted(tasks, key=lambda t: (t.q_start, t.k_start)):
        if t not in by_start.get((t.q_start, t.k_start), ()):
            continue  # already joined into a task above it
        by_start[(t.q_start, t.k_start)].remove(t)
        while True:
            below = by_start.get((t.q_end, t.k_start), ())
            joined = next(((b, m) for b in below for m in (merge_stacked(t, b),) if m is not None), None)
            if joined is None:
                break
            below.remove(joined[0])
            t = joined[1]
        out.append(t)
    return sorted(out, key=lambda t: (t.q_start, t.k_start))


def _split_full_rows(tasks) -> list[Task]:
    """Full tasks cut at the other tasks' row boundaries (the planner may have joined the rows of
    two query runs under one full task; cut, each piece can join its run's diagonal)."""
    cuts = sorted({x for t in tasks for x in (t.q_start, t.q_end)})
    out = []
    for t in tasks:
        if not t.is_full:
            out.append(t)
            continue
        inner = cuts[bisect.bisect_right(cuts, t.q_start):bisect.bisect_left(cuts, t.q_end)]
        edges = [t.q_start] + inner + [t.q_end]
        out += [Task(a, b, t.k_start, t.k_end) for a, b in zip(edges, edges[1:])]
    return out


def merge_rows(tasks) -> list[Task]:
    """Merge each query range's tasks whose keys are adjacent and whose union is one band; full
    tasks left over join again where they tile a larger rectangle; then tasks stacked on
    adjacent rows over the same first key where one band gives both (stack_rows)."""
    by_rows: dict = {}
    for t in _split_full_rows(tasks):
        by_rows.setdefault((t.q_start, t.q_end), []).append(t)
    out = []
    for group in by_rows.values():
        group = sorted(group, key=lambda t: t.k_start)
        merged = [group[0]]
        for t in group[1:]:
            joined = merge_adjacent(merged[-1], t)
            if joined is None:
                merged.append(t)
            else:
                merged[-1] = joined
        out += merged
    return stack_rows(coalesce_full(out))


def _gives(window: tuple[int, int], t: Task) -> bool:
    """Does the bottom-right `window` give task t exactly its band on t's shape?"""
    if min(window) < -1:
        return False
    got = Band.from_aligned_window(t.q_len, t.k_len, window).normalized(t.q_len, t.k_len)
    return got == t.band.normalized(t.q_len, t.k_len)


def step_launches(tasks) -> tuple[Launch, ...]:
    """A step's tasks as launches (module docstring): merged rows, one launch per aligned window,
    split where rows would repeat. Every launch's windows are valid flash-attn windows.

    A task that more than one window gives exactly (a one-row full task is also bottom-right
    causal) joins the window that holds the most rows: left to its own, a lone such row splits a
    step's launch in two and leaves the other with a gap, and a launch whose rows do not tile
    one range gathers and scatters all of them (measured on H100: a log-normal document mix at
    N = 2 ran at 0.46 of one GPU for one such row)."""
    merged = merge_rows(tasks)
    own = [t.band.aligned_window(t.q_len, t.k_len) for t in merged]
    for t, window in zip(merged, own):
        if min(window) < -1:  # (a trimmed task always has one; see plan/mask.py band_tasks)
            raise AssertionError(f"dtcp bug: task {t} has no bottom-right window")
    rows_of: dict = {}
    for t, window in zip(merged, own):
        rows_of[window] = rows_of.get(window, 0) + t.q_len
    by_rows = sorted(rows_of, key=lambda w: (-rows_of[w], w))
    groups: dict = {}  # window -> its launches, each a list of entries kept sorted (rows disjoint)
    for t, window in zip(merged, own):
        options = [w for w in by_rows if w == window or _gives(w, t)]
        entry = (t.q_start, t.q_end, t.k_start, t.k_end)
        placed = False
        for w in options:  # the first launch of these windows whose rows it does not touch
            for layer in groups.get(w, ()):
                if _rows_free(layer, t.q_start, t.q_end):
                    bisect.insort(layer, entry)
                    placed = True
                    break
            if placed:
                break
        if not placed:
            groups.setdefault(options[0], []).append([entry])
    launches = []
    for window in sorted(groups, key=by_rows.index):
        for layer in groups[window]:
            launches.append(Launch(window, tuple((a, b) for a, b, _, _ in layer), tuple((c, d) for _, _, c, d in layer)))
    return tuple(launches)


def _rows_free(layer: list, start: int, end: int) -> bool:
    """Do the rows [start, end) miss every entry of `layer` (sorted, rows disjoint)? Only the
    entries just before and at `start` can reach them: O(log n), where a scan of the layer made
    planning a step of thousands of tasks quadratic."""
    i = bisect.bisect_left(layer, (start,))
    return (i == 0 or layer[i - 1][1] <= start) and (i == len(layer) or end <= layer[i][0])


@lru_cache(maxsize=512)
def plan_launches(plan) -> tuple[tuple[Launch, ...], ...]:
    """Each step's launches (step_launches) of a RingPlan, keys counted as its tasks count them."""
    return tuple(step_launches(step.tasks) for step in plan.steps)


def fused_launches(plan, refuse=None):
    """plan_launches(plan) where running them is worth it, else None (the plan runs task by
    task): None where fusing saves no launch, or where `refuse(seq_lens, window)` (a kernel's
    reject_varlen_reason) gives a reason for one of the launches."""
    steps = plan_launches(plan)
    if sum(map(len, steps)) >= len(plan.tasks):
        return None
    if refuse is not None and any(refuse(launch.seq_lens, launch.window) is not None
                                  for launches in steps for launch in launches):
        return None
    return steps



def later_rows(steps) -> tuple[int, int]:
    """The hull of the query rows that the launches after a pass's first one (step 0's first)
    merge into or add to: (0, 0) when none. Where the first launch covers every row, the rows
    outside it have that launch's result, final (exec/ring.py writes it straight into the
    results). `steps`: each step's launches."""
    launches = [launch for step in steps for launch in step][1:]
    return _hull(r for launch in launches for r in launch.q_ranges)


def later_keys(steps, returned: tuple[int, int]) -> tuple[int, int]:
    """The hull of the rank's own keys whose dK/dV more than the local step's first launch adds
    to: the local step's other launches, and `returned` (the shares that come home at the chains'
    ends, RingPlan.returned_keys)."""
    return _hull([r for launch in steps[0][1:] for r in launch.k_ranges] + [returned])


#: roles of a run of query rows in a launch after the pass's first (`row_runs`): the only such
#: launch that reaches those rows, the first of several, one between, the last
ONLY, FIRST, MID, LAST = 0, 1, 2, 3
#: a pass routes its later launches' rows run by run (`row_runs`) only where no launch has more runs
#: than this, else the hull goes through float32. Set for the first, run-by-run form (a tensor op
#: per run: a DocZigzag step's launch holds ~100 ranges); on CUDA one launch now lands any number of
#: runs (exec/merge.py land_merge_), and only the CPU / no-Triton path pays per run. Raising it for
#: CUDA is unmeasured.
MAX_RUNS = 8


def in_place(launch: Launch, gaps: bool) -> bool:
    """Are a launch's query rows read and its results landed in place (one slice, or a window
    whose rows lie apart in order for a kernel that takes varlen gaps), not gathered?"""
    return launch.q_span is not None or (gaps and launch.q_in_order)


@lru_cache(maxsize=256)
def row_runs(launches: tuple[Launch, ...], gaps: bool):
    """Where each launch after a pass's first lands its query rows, or None where the pass keeps
    the hull in float32 (`later_rows`): some launch's rows are gathered (not `in_place`), or has
    more than MAX_RUNS runs. `launches`: the pass's launches in the order they run, its first
    (which covers every row and writes the results) first.

    Returns, per later launch, its rows as runs (start, end, role), in order, covering exactly
    its rows: ONLY where no other later launch reaches them (it merges into the result itself: in
    bf16, the same bits as a float32 accumulator seeded with the result and cast back, since
    both round once), else FIRST (reads the result, writes the float32 accumulator), MID
    (accumulator to accumulator) or LAST (reads the accumulator, writes the result). No row is
    copied into float32 or back beyond these launches' own merges and adds."""
    later = launches[1:]
    if not later:
        return ()
    if not all(in_place(launch, gaps) for launch in later):
        return None
    cuts = sorted({x for launch in later for r in launch.q_ranges for x in r})
    covering = [[] for _ in range(max(0, len(cuts) - 1))]  # the launches (in order) over each segment
    for j, launch in enumerate(later):
        for a, b in launch.q_ranges:
            for i in range(bisect.bisect_left(cuts, a), bisect.bisect_left(cuts, b)):
                covering[i].append(j)
    runs = [[] for _ in later]
    for i, who in enumerate(covering):
        a, b = cuts[i], cuts[i + 1]
        for pos, j in enumerate(who):
            role = ONLY if len(who) == 1 else FIRST if pos == 0 else LAST if pos == len(who) - 1 else MID
            mine = runs[j]
            if mine and mine[-1][1] == a and mine[-1][2] == role:
                mine[-1] = (mine[-1][0], b, role)
            else:
                mine.append((a, b, role))
    if max(map(len, runs)) > MAX_RUNS:
        return None
    return tuple(map(tuple, runs))


def accumulator_hull(runs) -> tuple[int, int]:
    """The hull of the rows `row_runs` sends through the float32 accumulator (roles other than ONLY)."""
    return _hull((a, b) for launch in runs for a, b, role in launch if role != ONLY)


#: float32 accumulator bytes per element of a later launch's rows, by role (row_runs), forward and
#: backward averaged: ONLY 6 (read the result and the launch's output, 2 + 2, write 2; the
#: backward's bf16 add the same); FIRST 12 (forward: read 2 + 2, write 4; backward: the result
#: copied in, 2 + 4, then the add, 4 + 2 + 4); MID 10 (read 4 + 2, write 4); LAST 8 (read 4 + 2, write 2)
ROLE_BYTES = {ONLY: 6, FIRST: 12, MID: 10, LAST: 8}


def accumulator_traffic(steps, local_len: int, gaps: bool = False) -> int:
    """Bytes per (query row x head x head-dim element) that the fused ring's float32 accumulators
    move in one pass, forward or backward (exec/ring.py with exec/fused.py), beyond the kernels.
    Where the local step's first launch covers every row it writes the results itself; the later
    launches then land run by run where `row_runs` routes them (ROLE_BYTES), else the hull of the
    rows they touch goes through float32 (`later_rows`): copied in after the first launch (read 2
    bytes, write 4) and back at the end (read 4, write 2), and each later launch merges (read 4 +
    2, write 4), 16 more where its rows are scattered (gathered in, merged, scattered back). Where
    the first launch does not cover every row: a zero fill (4) and the final cast (read 4, write
    2) over every row, and a merge per launch. `steps`: fused_launches(plan). (Where the pass
    keeps its later launches whole instead (exec/fused.py Slots: each later launch's rows read
    once, 2, and their hull read and written once, 4), this still counts the landing: the cost
    model's ring is then a little dearer than what runs; unmeasured against the transfers.)"""
    first = steps[0][0] if steps and steps[0] else None
    fill = first is not None and first.q_span == (0, local_len)
    if fill:
        runs = row_runs(tuple(launch for launches in steps for launch in launches), gaps)
        if runs is not None:
            return sum(ROLE_BYTES[role] * (b - a) for launch in runs for a, b, role in launch)
        start, end = later_rows(steps)
        total = 12 * (end - start)
    else:
        total = 10 * local_len
    for launches in steps:
        for launch in launches:
            if fill and launch is first:
                continue
            rows = launch.cu_q[-1]
            gathered = not in_place(launch, gaps)
            total += 10 * rows + (16 * rows if gathered else 0)
    return total
