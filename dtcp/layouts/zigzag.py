"""Zigzag: 2N equal chunks; rank r holds chunk r and chunk 2N-1-r.

    Zigzag()            rank 0: 0 1 2 3 | 12 13 14 15    rank 1: 4 5 6 7 | 8 9 10 11

Under a causal mask every rank then does the same work at every ring step (half a block).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .base import Layout


def zigzag_runs(start: int, length: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The two zigzag chunks of `rank` in [start, start + length) (length a multiple of 2N)."""
    c = length // (2 * world_size)
    hi = 2 * world_size - 1 - rank
    return [(start + rank * c, start + (rank + 1) * c), (start + hi * c, start + (hi + 1) * c)]


@dataclass(frozen=True, repr=False)
class Zigzag(Layout):
    """2N equal chunks; rank r holds chunk r then chunk 2N-1-r. Balances causal work exactly."""

    #: the tensor dim it splits, when used as a DTensor placement (dtcp.distribute_tensor); else None
    dim: Optional[int] = dataclasses.field(default=None, kw_only=True)
    name = "zigzag"

    def __post_init__(self):
        self._check_dim()

    def multiple(self, world_size: int) -> int:
        return 2 * world_size

    def runs(self, seq_len, world_size, rank):
        return zigzag_runs(0, seq_len, world_size, rank)

    def causal_blocks(self, local_len, world_size, rank, src):
        if src == rank:
            return super().causal_blocks(local_len, world_size, rank, src)
        c = local_len // 2
        if src < rank:
            # Both of my chunks come after the source's low chunk and before its high chunk.
            return [(0, local_len, 0, c, None)]
        # Only my high chunk sees the source, and it sees both of the source's chunks.
        return [(c, local_len, 0, local_len, None)]
