"""Striped: blocks of `block` tokens dealt round-robin (block i goes to rank i mod N).

    Striped(block=1)    rank 0: 0 2 4 6 8 10 12 14       rank 1: 1 3 5 7 9 11 13 15
    Striped(block=2)    rank 0: 0 1 4 5 8 9 12 13        rank 1: 2 3 6 7 10 11 14 15
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .base import Layout


@dataclass(frozen=True, repr=False)
class Striped(Layout):
    """Blocks of `block` tokens dealt round-robin: block i goes to rank i mod N."""

    block: int = 1
    #: the tensor dim it splits, when used as a DTensor placement (dtcp.distribute_tensor); else None
    dim: Optional[int] = dataclasses.field(default=None, kw_only=True)
    name = "striped"

    def __post_init__(self):
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"Striped(block=...) must be a positive int; got {self.block!r}")
        self._check_dim()

    def multiple(self, world_size: int) -> int:
        return world_size * self.block

    def runs(self, seq_len, world_size, rank):
        b = self.block
        return [(i * b, (i + 1) * b) for i in range(rank, seq_len // b, world_size)]

    def causal_blocks(self, local_len, world_size, rank, src):
        if src == rank:
            return super().causal_blocks(local_len, world_size, rank, src)
        b = self.block
        if b == 1:
            if src < rank:
                return [(0, local_len, 0, local_len, 0)]  # key j is at or before query i iff j <= i
            # Strictly before: j < i. Drop query row 0 and the last key: then it is j <= i.
            return [(1, local_len, 0, local_len - 1, 0)] if local_len > 1 else []
        # Blocks of b tokens: query block m sees whole key blocks 0..m (src < rank) or 0..m-1.
        n = local_len // b
        if src < rank:
            return [(m * b, (m + 1) * b, 0, (m + 1) * b, None) for m in range(n)]
        return [(m * b, (m + 1) * b, 0, m * b, None) for m in range(1, n)]

    def spec(self) -> str:
        return f"striped:{self.block}"
