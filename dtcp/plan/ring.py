"""The ring schedule: at each step, which K/V block this rank holds and which kernel calls it
makes on it. Pure Python over integers; no process group, no tensors.

Step 0 is the rank's own block. The other steps form at most two *chains*: a left chain in which
blocks travel forward (rank r holds the block of rank r - d at its d-th step, shift +1) and a right
chain in which they travel backward (the block of rank r + d, shift -1). Without a window or
documents every block is needed and the plan is the classic ring: one left chain of N - 1 steps.
With a sliding window or document mask the plan keeps only the offsets some rank needs, and
picks the split between the two chains with the fewest rounds, then the fewest keys on the
wire per round (`_chain_splits`, `round_keys`).

Each step lists `Task`s (plan/mask.py), trimmed so that no kernel sees a fully masked row and no
masked-out block is computed. Every causal task the plain fast path emits is square, so
top-left and bottom-right aligned kernels agree on it.

A block travels only as far as its chain needs it, and only the keys its holders use: the
block's *span* in a chain is the hull of the key ranges of every task any holder runs on it
(a sliding window of W < M tokens sends the last W keys of each block, not all M; a block no
holder uses sends nothing). The span is the same at every hop of a chain, so a holder forwards
what it received as it is, and its dK/dV travel back with the same span.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

from ..layouts import Layout
from .mask import AttnMask, Task, band_tasks, documents_reached


@dataclass(frozen=True)
class Step:
    src: int  # the rank whose K/V block is held at this step
    # Kernel calls on the block; their key indices count from the start of src's whole block.
    tasks: tuple[Task, ...]
    # How the block got here: received from rank - shift (+1: left chain, -1: right chain,
    # 0: the local block at step 0).
    shift: int = 1
    # The keys [start, end) of src's block held at this step (its span in this chain: what
    # travels), and the span of this rank's own block in the same chain (what it sends when the
    # chain starts, and what comes home at its end). (0, 0): nothing.
    span: tuple[int, int] = (0, 0)
    home_span: tuple[int, int] = (0, 0)
    # Where blocks come straight from their home rank (the ring in groups, exec/grouped.py), only
    # what one holder uses travels: the hull of this step's own tasks' keys of src's block, and
    # the hull of the keys of this rank's block that the rank holding it at the same step uses
    # (every rank's step t is the same offset, so that rank receives this rank's block then).
    # Tighter than the chain's spans, which hold what every later holder needs: under a causal
    # zigzag mask a rank uses the first half of each lower rank's block.
    direct_span: tuple[int, int] = (0, 0)
    direct_home_span: tuple[int, int] = (0, 0)
    # A chain of one holder (its block goes one rank on and its dK/dV come straight home) whose
    # holder's tasks, on every rank, touch each key of the block at most once: what goes home
    # is one kernel share per key, so it travels in the kernel's gradient dtype as the kernel
    # returned it (bf16 instead of float32 under bf16: half the bytes, the same values), and is
    # added in float32 at home. The same on every rank's step t (sender and receiver agree).
    one_share: bool = False

    @property
    def span_len(self) -> int:
        return self.span[1] - self.span[0]

    @property
    def direct_len(self) -> int:
        return self.direct_span[1] - self.direct_span[0]


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

    # Derived once per plan (plans are cached by value) rather than on every ring call.
    @cached_property
    def max_span_len(self) -> int:
        """The most keys of a block this rank receives in one round, K/V or dK/dV coming home
        (0: none)."""
        return max((max(s.span_len, s.home_span[1] - s.home_span[0]) for s in self.steps[1:]), default=0)

    @cached_property
    def max_direct_len(self) -> int:
        """max_span_len of the direct transfers (Step.direct_span, direct_home_span)."""
        return max((max(s.direct_len, s.direct_home_span[1] - s.direct_home_span[0]) for s in self.steps[1:]),
                   default=0)

    @cached_property
    def chain_ends(self) -> tuple[int, ...]:
        """The steps that end a chain: there the held block's dK/dV go home."""
        rounds = self.num_rounds
        return tuple(t for t in range(1, rounds + 1) if t == rounds or self.starts_chain(t + 1))

    @cached_property
    def local_calls_disjoint(self) -> bool:
        """Do the local step's kernel calls touch pairwise disjoint rows and pairwise disjoint
        keys (one call over the whole block, or one per document)? Then each row's (key's) local
        result comes from one call."""
        tasks = self.steps[0].tasks
        return _disjoint([(t.q_start, t.q_end) for t in tasks]) and _disjoint([(t.k_start, t.k_end) for t in tasks])

    @cached_property
    def merged_rows(self) -> tuple[int, int]:
        """The hull of the rows the steps after the local one touch: (0, 0) when none."""
        return _hull((t.q_start, t.q_end) for s in self.steps[1:] for t in s.tasks)

    @cached_property
    def returned_keys(self) -> tuple[int, int]:
        """The hull of this rank's own keys whose dK/dV come home at the chains' ends."""
        return _hull(self.steps[t].home_span for t in self.chain_ends)

    @cached_property
    def used_keys(self) -> tuple[int, int]:
        """The hull of this rank's own keys other ranks use (every received step's home span):
        in groups (exec/grouped.py) each step's dK/dV share of them comes home."""
        return _hull(s.home_span for s in self.steps[1:])

    @cached_property
    def direct_used_keys(self) -> tuple[int, int]:
        """used_keys of the direct transfers: the hull of every received step's direct home span."""
        return _hull(s.direct_home_span for s in self.steps[1:])

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(task for step in self.steps for task in step.tasks)

    def starts_chain(self, t: int) -> bool:
        """Does step t's block come straight from its home rank (whose sender sends its own,
        local K/V) rather than forwarded by the previous holder?"""
        return t > 0 and self.steps[t].shift != self.steps[t - 1].shift


def _hull(ranges) -> tuple[int, int]:
    """The smallest [start, end) holding every non-empty range of `ranges`; (0, 0) when none."""
    ranges = [(a, b) for a, b in ranges if b > a]
    return (min(a for a, _ in ranges), max(b for _, b in ranges)) if ranges else (0, 0)


def _disjoint(ranges) -> bool:
    ranges = sorted(ranges)
    return all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def ring_plan(layout: Layout, local_len: int, world_size: int, rank: int, is_causal: bool,
              mask: Optional[AttnMask] = None) -> RingPlan:
    """This rank's plan (see ring_plans)."""
    return ring_plans(layout, local_len, world_size, is_causal, mask)[rank]


@lru_cache(maxsize=256)
def ring_plans(layout: Layout, local_len: int, world_size: int, is_causal: bool,
               mask: Optional[AttnMask] = None) -> tuple[RingPlan, ...]:
    """Every rank's plan (ranks exchange in lockstep, so every plan has the same steps). `mask`
    (window and documents) replaces `is_causal` when given. Cached by value."""
    n = world_size
    if mask is None:
        mask = AttnMask.make(is_causal)
    seq_len = local_len * n
    runs: dict[int, list] = {}  # each rank's runs, asked for once (n^2 rank pairs read them)

    def runs_of(rank: int) -> list:
        if rank not in runs:
            runs[rank] = layout.runs(seq_len, n, rank)
        return runs[rank]

    docs: dict[int, frozenset] = {}  # under a document mask: the documents each rank's runs reach

    def docs_of(rank: int) -> frozenset:
        if rank not in docs:
            docs[rank] = frozenset(documents_reached(runs_of(rank), mask.segment_starts))
        return docs[rank]

    def tasks_of(rank: int, src: int) -> list[Task]:
        if mask.is_plain:
            if mask.hi is None:
                return [Task(0, local_len, 0, local_len)]
            blocks = layout.causal_blocks(local_len, n, rank, src)
            if blocks is not None:
                return [Task(q0, q1, k0, k1, None, hi) for q0, q1, k0, k1, hi in blocks]
        # Two ranks that hold pieces of no common document have nothing to compute together: most
        # of the N^2 pairs of a packed batch at N = 8-16, which every rank plans for every new batch.
        if mask.segments is None:
            return band_tasks(runs_of(rank), runs_of(src), mask, seq_len)
        if rank != src and docs_of(rank).isdisjoint(docs_of(src)):
            return []
        return band_tasks(runs_of(rank), runs_of(src), mask, seq_len, k_documents=docs_of(src))

    table = {(r, d): tuple(tasks_of(r, (r - d) % n)) for r in range(n) for d in range(n)}
    needed = {d for (r, d), tasks in table.items() if d and tasks}

    def spans_of(left: int, right: int) -> dict:
        """(block, shift) -> the hull of the keys of `block` that the holders of that chain use."""
        chains = {1: range(1, left + 1), -1: range(-1, -right - 1, -1)}  # offsets d: rank r holds block r - d
        spans = {}
        for b in range(n):
            for shift, offsets in chains.items():
                spans[b, shift] = _hull((t.k_start, t.k_end) for d in offsets for t in table[(b + d) % n, d % n])
        return spans

    def round_keys(split, spans) -> int:
        """Keys on the wire per rank, summed over rounds: every hop of a chain moves every block
        one rank on in lockstep, so a round lasts as long as its largest span takes."""
        widest = {shift: max(spans[b, shift][1] - spans[b, shift][0] for b in range(n)) for shift in (1, -1)}
        return split[0] * widest[1] + split[1] * widest[-1]

    # Fewest rounds first, then the fewest keys per round (a window reaching both ways is cheaper
    # as two short chains than as one long one whose spans grow to whole blocks), then the
    # longest left chain (the classic ring).
    candidates = [(split, spans_of(*split)) for split in _chain_splits(needed, n)]
    (left, right), spans = min(candidates, key=lambda c: round_keys(*c))
    offsets = [(d, 1) for d in range(1, left + 1)] + [(-d, -1) for d in range(1, right + 1)]

    def used(rank: int, d: int) -> tuple[int, int]:  # the keys of block rank - d that rank's tasks use
        return _hull((t.k_start, t.k_end) for t in table[rank, d % n])

    # A chain of one hop whose every holder's tasks take each key of the block at most once
    # (Step.one_share): decided over all ranks, so the two ends of every return agree.
    one_share = {d: (left if d > 0 else right) == 1 and
                 all(_disjoint([(t.k_start, t.k_end) for t in table[r, d % n]]) for r in range(n))
                 for d, _ in offsets}

    def steps_of(r: int) -> tuple[Step, ...]:
        own = Step(r, table[r, 0], 0, (0, local_len), (0, local_len), (0, local_len), (0, local_len))
        return (own,) + tuple(Step((r - d) % n, table[r, d % n], shift, spans[(r - d) % n, shift], spans[r, shift],
                                   used(r, d), used((r + d) % n, d), one_share[d])
                              for d, shift in offsets)

    return tuple(RingPlan(n, r, local_len, steps_of(r)) for r in range(n))


def _chain_splits(needed: set[int], n: int) -> list[tuple[int, int]]:
    """The splits (a, b) into a left chain (offsets 1..a) and a right chain (offsets n-1..n-b,
    that is sources r+1..r+b) that cover every needed offset with the fewest rounds a + b, the
    longest left chain first."""
    if not needed:
        return [(0, 0)]
    splits = []
    for a in range(n):
        rest = [d for d in needed if d > a]
        splits.append((a, n - min(rest) if rest else 0))
    fewest = min(a + b for a, b in splits)
    return sorted({s for s in splits if sum(s) == fewest}, key=lambda s: s[1])
