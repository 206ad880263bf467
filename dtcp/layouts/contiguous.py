"""Contiguous: rank r holds tokens [r*S/N, (r+1)*S/N). SlidingWindow: the same, carrying a window.

    Contiguous()        rank 0: 0 1 2 3 4 5 6 7          rank 1: 8 9 10 11 12 13 14 15
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .base import Layout, check_window


@dataclass(frozen=True, repr=False)
class Contiguous(Layout):
    """Rank r holds tokens [r*S/N, (r+1)*S/N). The natural layout for sliding windows."""

    #: the tensor dim it splits, when used as a DTensor placement (dtcp.distribute_tensor); else None
    dim: Optional[int] = dataclasses.field(default=None, kw_only=True)
    name = "contiguous"

    def __post_init__(self):
        self._check_dim()

    def multiple(self, world_size: int) -> int:
        return world_size

    def runs(self, seq_len, world_size, rank):
        m = seq_len // world_size
        return [(rank * m, (rank + 1) * m)]

    def causal_blocks(self, local_len, world_size, rank, src):
        if src == rank:
            return super().causal_blocks(local_len, world_size, rank, src)
        # Earlier ranks are entirely in the past, later ranks entirely in the future.
        return [(0, local_len, 0, local_len, None)] if src < rank else []


@dataclass(frozen=True, repr=False)
class SlidingWindow(Contiguous):
    """The contiguous placement carrying a sliding window: query i sees keys j with
    i - left <= j <= i + right (-1 = unbounded). `ring_attention(..., layout=SlidingWindow(4096))`
    runs windowed attention in ceil(4096 / S_local) communication rounds instead of N - 1."""

    left: int = -1
    right: int = 0
    name = "window"

    def __post_init__(self):
        check_window((self.left, self.right), "SlidingWindow(left, right)")

    @property
    def window(self) -> tuple[int, int]:
        return (self.left, self.right)

    def spec(self) -> str:
        return f"window:{self.left}:{self.right}"
