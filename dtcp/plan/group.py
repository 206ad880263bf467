"""Ring steps in groups: the blocks of G consecutive steps as one or two launches
(`dtcp.config.ring_steps_per_launch` = G > 1).

Why. A ring rank splits its work over the steps: at N ranks each step's launch holds about 1/N
of it. On one H100 (FA4 4.0.0b36, bf16, 32/8 heads, D = 128) a step's launch of a rank of a
long-tailed 128K batch at N = 16 (2161 query rows against 4321 keys) ran at 550 TFLOPs forward
and 505 backward; the same batch's whole-sequence call at 721 and 607; launches twice and four
times as long (N = 8 and 4) at 640-650 / 573-605 and 689 / 640-660. Every launch also merges its
rows into the float32 accumulators once. A group's launch holds G steps' keys: fewer, longer
launches and one merge where there were G.

How. Step t's launches (plan/fuse.py) are, off the local step and without sliding windows, *full*
sequences: query rows against a run of the held block's keys, every key visible. A group's
launch splits the query rows at every boundary of its steps' sequences; each piece of rows is one
sequence whose keys are the key runs of every step that sees those rows, one after another in a
packed buffer (`pieces`). A key two sequences share is packed twice (its dK/dV get both shares).
Full sequences make the order of the runs free. Groups are refused (None) where a step has a
launch that is not full: then the executor runs that rank's steps one by one on the same blocks.

In place (`InPlaceGroup`, dtcp.config.ring_groups_in_place). The packing copies and the
shares' copies and adds cost more than the launches save on the device (twenty-fourth session:
0.5-0.9 ms a pass at N = 8, where the launches saved 4-9%). Where a group's sequences can be cut
into at most MAX_IN_PLACE_LAUNCHES launches that each read one range of a buffer holding the
group's blocks one after another, the blocks are received straight into that buffer and each
launch reads its range as it is: no key is copied, and each launch writes its dK/dV into the same
rows of a buffer of the same shape, whose slices go home as the steps' shares. Sequences of one
step with the same keys and touching rows are one sequence, and so are sequences of the same rows
whose keys touch (consecutive steps' blocks). A causal zigzag rank's group is then two launches:
all its rows against the first halves of the lower ranks' blocks, its second half against the
higher ranks' whole blocks. Where keys are shared or the sequences need more launches, the
group is packed as above.

What travels is the executor's (dtcp/exec/grouped.py): each step's block comes straight from its
home rank (only the keys this rank uses, Step.direct_span), and its dK/dV share goes straight
back, so a group's blocks can all be held at once. Keys here count from the direct span's start.
Pure Python over the plan's integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .fuse import Launch, plan_launches
from .mask import union_ranges

FULL = (-1, -1)

#: an in-place group runs as at most this many launches (more: packed, one launch). A causal zigzag
#: rank's group needs two (its rows overlap: all of them against the lower ranks' blocks, the
#: second half against the higher ranks'); each launch adds FA4's per-launch costs (its backward's
#: pre/post-processing, a merge).
MAX_IN_PLACE_LAUNCHES = 2


@dataclass(frozen=True)
class StepGroup:
    """One launch over the blocks of `steps` (plan step indices, consecutive, >= 1).

    `launch`: sequence i is rows `launch.q_ranges[i]` of the rank's queries against keys
    `launch.k_ranges[i]` of the packed buffer (which they tile, in order), window full; None
    where this rank has nothing to compute on these blocks.
    `pieces`: the packed buffer, run by run: (j, start, end) = keys [start, end) of the span held
    at step steps[j], counted from the span's start."""

    steps: tuple[int, ...]
    launch: Optional[Launch]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def packed_len(self) -> int:
        return sum(e - a for _, a, e in self.pieces)

    @property
    def launches(self) -> tuple[Launch, ...]:
        return () if self.launch is None else (self.launch,)


@dataclass(frozen=True)
class InPlaceGroup:
    """The blocks of `steps` received one after another into one buffer of `length` keys (step
    steps[j]'s direct span at rows offsets[j]..), and the `launches` that read it in place: keys
    counted in the buffer; each launch's keys tile one range of it (its hull, a view), the
    launches' hulls are disjoint (each writes its dK/dV into its own rows of a buffer of the same
    shape), and a launch's query rows are disjoint and in order (plan/fuse.py Launch), window
    full. `zeros`: the buffer's rows no launch reads, whose dK/dV shares are 0."""

    steps: tuple[int, ...]
    offsets: tuple[int, ...]
    length: int
    launches: tuple[Launch, ...]
    zeros: tuple[tuple[int, int], ...]

    packed_len = 0  # (nothing is copied into a packed buffer)


@lru_cache(maxsize=1024)
def share_writes(group: StepGroup, span_lens: tuple[int, ...]) -> tuple[tuple, ...]:
    """How the group launch's dK/dV (packed like its keys) become each step's share, the
    gradient of that step's held span: per step j, (writes, zeros). `writes`: (first, a, e, off)
    in packed order, keys [a, e) of the span from packed rows [off, off + e - a), `first` where no
    earlier piece wrote those keys (a copy; else an add: a key packed twice gets both shares, in
    packed order). `zeros`: the span's keys no piece holds, [a, e). Copies where there were a zero
    fill and an add give the same float32 values: 0 + x is x. span_lens[j]: step j's span length."""
    out = []
    for j, span_len in enumerate(span_lens):
        writes, covered, off = [], [], 0
        for jj, a, e in group.pieces:
            if jj == j:
                for x, y, first in _split_covered(a, e, covered):
                    writes.append((first, x, y, off + x - a))
                covered = union_ranges([*covered, (a, e)])
            off += e - a
        zeros, at = [], 0
        for x, y in covered:
            if x > at:
                zeros.append((at, x))
            at = max(at, y)
        if at < span_len:
            zeros.append((at, span_len))
        out.append((tuple(writes), tuple(zeros)))
    return tuple(out)


def _split_covered(a: int, e: int, covered) -> list[tuple[int, int, bool]]:
    """[a, e) cut at the edges of the sorted, disjoint `covered` ranges: (x, y, not covered)."""
    parts, at = [], a
    for x, y in covered:
        if y <= at or x >= e:
            continue
        if x > at:
            parts.append((at, x, True))
        parts.append((max(at, x), min(e, y), False))
        at = min(e, y)
    if at < e:
        parts.append((at, e, True))
    return parts


def step_chunks(num_steps: int, size: int) -> tuple[tuple[int, ...], ...]:
    """Steps 1 .. num_steps - 1 (the received blocks) in consecutive groups of `size` (the last
    may be shorter). Step 0, the local block, is never in a group: it runs while the first group's
    blocks arrive."""
    rounds = list(range(1, num_steps))
    return tuple(tuple(rounds[i:i + size]) for i in range(0, len(rounds), size))


def group_launch(plan, steps: tuple[int, ...]) -> Optional[StepGroup]:
    """The group's one launch, or None where one of its steps has a launch that is not full."""
    per_step = plan_launches(plan)
    entries = []  # (row start, row end, j, key start, key end): keys from the direct span's start
    for j, t in enumerate(steps):
        origin = plan.steps[t].direct_span[0]
        for launch in per_step[t]:
            if launch.window != FULL:
                return None
            for (qa, qb), (ka, kb) in zip(launch.q_ranges, launch.k_ranges):
                entries.append((qa, qb, j, ka - origin, kb - origin))
    if not entries:
        return StepGroup(tuple(steps), None, ())
    cuts = sorted({x for e in entries for x in e[:2]})
    segments = []  # [row start, row end, runs]
    for x, y in zip(cuts, cuts[1:]):
        runs = tuple(sorted((j, ka, kb) for qa, qb, j, ka, kb in entries if qa <= x and y <= qb))
        if not runs:
            continue
        if segments and segments[-1][1] == x and segments[-1][2] == runs:
            segments[-1][1] = y  # the same keys as the rows just above: one sequence
        else:
            segments.append([x, y, runs])
    q_ranges, k_ranges, pieces, off = [], [], [], 0
    for x, y, runs in segments:
        start = off
        for j, ka, kb in _joined(runs):
            pieces.append((j, ka, kb))
            off += kb - ka
        q_ranges.append((x, y))
        k_ranges.append((start, off))
    return StepGroup(tuple(steps), Launch(FULL, tuple(q_ranges), tuple(k_ranges)), tuple(pieces))


def _joined(runs):
    """Runs of one step that touch, as one (fewer copies into the packed buffer)."""
    out = []
    for j, ka, kb in runs:
        if out and out[-1][0] == j and out[-1][2] == ka:
            out[-1] = (j, out[-1][1], kb)
        else:
            out.append((j, ka, kb))
    return out


def in_place_group(plan, steps: tuple[int, ...], most: int = MAX_IN_PLACE_LAUNCHES) -> Optional[InPlaceGroup]:
    """The group's launches read in place (InPlaceGroup), or None where one of its steps has a
    launch that is not full, two of its sequences share a key, or they need more than `most`
    launches."""
    per_step = plan_launches(plan)
    offsets, seqs, length = [], [], 0
    for t in steps:
        step = plan.steps[t]
        origin = step.direct_span[0]
        offsets.append(length)
        for launch in per_step[t]:
            if launch.window != FULL:
                return None
            for (qa, qb), (ka, kb) in zip(launch.q_ranges, launch.k_ranges):
                seqs.append((qa, qb, ka - origin + length, kb - origin + length))
        length += step.direct_len
    seqs = sorted(_coalesced(seqs), key=lambda s: (s[2], s[0]))
    if any(a[3] > b[2] for a, b in zip(seqs, seqs[1:])):
        return None  # a key in two sequences (its dK/dV would be written twice)
    runs = []  # each launch's sequences: keys touching, rows after the last one's
    for s in seqs:
        if runs and runs[-1][-1][3] == s[2] and runs[-1][-1][1] <= s[0]:
            runs[-1].append(s)
        else:
            runs.append([s])
    if len(runs) > most:
        return None
    zeros, at = [], 0
    for run in runs:
        if run[0][2] > at:
            zeros.append((at, run[0][2]))
        at = run[-1][3]
    if at < length:
        zeros.append((at, length))
    launches = tuple(Launch(FULL, tuple((qa, qb) for qa, qb, _, _ in run), tuple((ka, kb) for _, _, ka, kb in run))
                     for run in runs)
    return InPlaceGroup(tuple(steps), tuple(offsets), length, launches, tuple(zeros))


def _coalesced(seqs) -> list[tuple[int, int, int, int]]:
    """Full sequences (row start, row end, key start, key end) joined where one is two: the same
    keys and touching rows, or the same rows and touching keys (every pair visible either way),
    until none joins."""
    seqs = list(seqs)
    while True:
        before = len(seqs)
        for join_keys in (False, True):  # rows of the same keys, then keys of the same rows
            order = (lambda s: (s[0], s[1], s[2])) if join_keys else (lambda s: (s[2], s[3], s[0]))
            out = []
            for s in sorted(seqs, key=order):
                if out and join_keys and out[-1][:2] == s[:2] and out[-1][3] == s[2]:
                    out[-1] = (s[0], s[1], out[-1][2], s[3])
                elif out and not join_keys and out[-1][2:] == s[2:] and out[-1][1] == s[0]:
                    out[-1] = (out[-1][0], s[1], s[2], s[3])
                else:
                    out.append(s)
            seqs = out
        if len(seqs) == before:
            return seqs


def group_launches(plan, size: int, refuse=None, in_place: bool = True):
    """Every group of `size` steps (step_chunks): an InPlaceGroup where one can be (and `in_place`),
    else its one packed launch (StepGroup); None where a group can be neither, or where
    `refuse(seq_lens, window)` (a kernel's reject_varlen_reason) gives a reason for one of the
    launches (the rank then runs its received blocks step by step)."""
    groups = _group_launches(plan, size, in_place)
    if groups is not None and refuse is not None and any(
            refuse(launch.seq_lens, launch.window) is not None for g in groups for launch in g.launches):
        return None
    return groups


@lru_cache(maxsize=256)
def _group_launches(plan, size: int, in_place: bool):
    groups = []
    for steps in step_chunks(len(plan.steps), size):
        group = (in_place_group(plan, steps) if in_place else None) or group_launch(plan, steps)
        if group is None:
            return None
        groups.append(group)
    return tuple(groups)
