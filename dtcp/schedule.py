"""Per-step ring schedule: at each step, which K/V block this rank holds and which kernel calls
it makes on it. Pure Python over integers; no process group, no tensors.

At step t rank r holds the K/V block that rank (r - t) mod N started with (the *source*).
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

from dataclasses import dataclass
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


def ring_plan(layout: Layout, local_len: int, world_size: int, rank: int, is_causal: bool) -> RingPlan:
    steps = []
    for t in range(world_size):
        src = (rank - t) % world_size
        steps.append(Step(src, tuple(_tasks(layout, local_len, rank, src, is_causal))))
    return RingPlan(world_size, rank, local_len, tuple(steps))


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
