"""Grouped: a layout over N ranks seen at the granularity of groups of `inner` consecutive ranks.

Ulysses and hybrid context parallelism exchange heads for tokens inside groups of `inner`
consecutive ranks (the Ulysses group of a 2-D mesh, ring-major: CP rank = ring rank * inner +
Ulysses rank). After the exchange each member of group p holds the tokens of all of the group's
ranks, for a share of the heads. `Grouped(base, inner)` over R = N / inner ranks is that token
set: rank p holds the union of `base`'s shards of ranks p*inner ... p*inner + inner - 1, in
increasing global order (whatever the base's local order). The ring across groups runs on it.

    Zigzag() over 4 ranks, inner 2: ranks 0, 1 hold chunks {0, 7} and {1, 6} of 8;
    Grouped(Zigzag(), 2) over 2 ranks: rank 0 holds chunks 0 1 | 6 7 (the zigzag of 2 ranks).

Pure index math: any base layout works (the planner derives causal blocks from the runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Layout


@dataclass(frozen=True, repr=False)
class Grouped(Layout):
    """`base`'s shards of each `inner` consecutive ranks, merged (see the module docstring)."""

    base: Layout
    inner: int
    name = "grouped"

    def __post_init__(self):
        if not isinstance(self.base, Layout):
            raise TypeError(f"Grouped(base, inner): base must be a Layout; got {type(self.base).__name__}")
        if not isinstance(self.inner, int) or isinstance(self.inner, bool) or self.inner < 1:
            raise ValueError(f"Grouped(base, inner): inner must be a positive int; got {self.inner!r}")

    def multiple(self, world_size: int) -> int:
        return self.base.multiple(world_size * self.inner)

    def check(self, seq_len: int, world_size: int) -> None:
        self.base.check(seq_len, world_size * self.inner)

    def runs(self, seq_len, world_size, rank):
        n = world_size * self.inner
        runs = sorted(r for j in range(self.inner) for r in self.base.runs(seq_len, n, rank * self.inner + j))
        merged: list[tuple[int, int]] = []
        for a, b in runs:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged

    def spec(self) -> str:
        return f"grouped:{self.inner}:{self.base.spec()}"

    def __repr__(self) -> str:
        return f"Grouped({self.base!r}, {self.inner})"
