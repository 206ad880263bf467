"""The ring schedule: at each step, which K/V block this rank holds and which kernel calls it
makes on it. Pure Python over integers; no process group, no tensors.

Step 0 is the rank's own block. The other steps form at most two *chains*: a left chain in which
blocks travel forward (rank r holds the block of rank r - d at its d-th step, shift +1) and a right
chain in which they travel backward (the block of rank r + d, shift -1). Without a window or
documents every block is needed and the plan is the classic ring: one left chain of N - 1 steps.
With a sliding window or document mask the plan keeps only the offsets some rank needs, and
picks the split between the two chains that sends the fewest blocks (`_choose_chains`).

Each step lists `Task`s (plan/mask.py), trimmed so that no kernel sees a fully masked row and no
masked-out block is computed. Every causal task the plain fast path emits is square, so
top-left and bottom-right aligned kernels agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..layouts import Layout
from .mask import AttnMask, Task, band_tasks


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

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(task for step in self.steps for task in step.tasks)

    def starts_chain(self, t: int) -> bool:
        """Does step t's block come straight from its home rank (whose sender sends its own,
        local K/V) rather than forwarded by the previous holder?"""
        return t > 0 and self.steps[t].shift != self.steps[t - 1].shift


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

    def tasks_of(rank: int, src: int) -> list[Task]:
        if mask.is_plain:
            if mask.hi is None:
                return [Task(0, local_len, 0, local_len)]
            blocks = layout.causal_blocks(local_len, n, rank, src)
            if blocks is not None:
                return [Task(q0, q1, k0, k1, None, hi) for q0, q1, k0, k1, hi in blocks]
        return band_tasks(layout.runs(seq_len, n, rank), layout.runs(seq_len, n, src), mask, seq_len)

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
