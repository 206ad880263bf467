"""The Layout base class: which global tokens each rank of a context-parallel group holds.

A layout is pure index math over (seq_len, world_size, rank). Every layout here but `Balanced`
keeps the tokens of one rank in increasing global order, so "key j is not after query i" in
global positions is the same as "j <= i" in local indices when both come from the same rank: the
plain causal fast path (`causal_blocks`) relies on that. `Balanced` (always under its document
mask, never the plain fast path) keeps only each document's pieces in global order and puts the
pieces it shares with other ranks first; the planner's general path (plan/mask.py `band_tasks`)
works from global positions and takes any local order.

`shard`, `unshard` and `positions` are conveniences that apply the index math to tensors of a
process group; they are implemented in `dtcp.layouts.sharding`.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Optional

import torch

from .._compat import mark_length_dynamic
from .._groups import GroupLike, cp_size_and_rank
from . import sharding

# A causal fast-path block: queries [q0, q1) of this rank against keys [k0, k1) of the source
# rank, with key j visible from query i iff j - i <= hi (None: all visible). Local indices.
CausalBlock = tuple[int, int, int, int, Optional[int]]


class Layout:
    """Base class. Subclasses define `multiple` and `runs`, and may define `causal_blocks`."""

    #: short name used in specs, configs and error messages
    name: str = "layout"

    # ---- pure index math -------------------------------------------------------------
    def multiple(self, world_size: int) -> int:
        """The sequence length must be a multiple of this."""
        raise NotImplementedError

    def runs(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """Half-open global ranges [start, end) held by `rank`, in local order."""
        raise NotImplementedError

    def causal_blocks(self, local_len: int, world_size: int, rank: int, src: int) -> Optional[list[CausalBlock]]:
        """Under a plain causal mask, the blocks of `rank`'s queries that see `src`'s keys, or
        None to let the planner derive them from `runs` (always correct, a little slower to plan).
        The rank's own block is causal in local indices for every layout (see the module
        docstring)."""
        if src == rank:
            return [(0, local_len, 0, local_len, 0)]
        return None

    def check(self, seq_len: int, world_size: int) -> None:
        m = self.multiple(world_size)
        if seq_len <= 0 or seq_len % m != 0:
            raise ValueError(
                f"{self!r} over {world_size} ranks needs a sequence length that is a positive "
                f"multiple of {m}; got {seq_len}. Pad the sequence to a multiple of {m}."
            )

    def local_len(self, seq_len: int, world_size: int) -> int:
        self.check(seq_len, world_size)
        return seq_len // world_size

    def global_positions(self, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
        """1-D int64 tensor: the global position of each local token of `rank`."""
        self.check(seq_len, world_size)
        return positions_of(self, seq_len, world_size, rank).clone()

    def permutation(self, seq_len: int, world_size: int) -> torch.Tensor:
        """Global positions of all ranks' tokens, rank 0's first: gathering shards gives x[perm]."""
        return torch.cat([self.global_positions(seq_len, world_size, r) for r in range(world_size)])

    # ---- tensors of a process group ----------------------------------------------------
    def positions(self, seq_len: int, group: GroupLike = None) -> torch.Tensor:
        """Global positions of this rank's tokens, in local order (feed these to RoPE). `group`: 1-D,
        or a 2-D CP mesh / (ring, ulysses) pair."""
        n, r = cp_size_and_rank(group)
        return self.global_positions(seq_len, n, r)

    def shard(self, x: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
        """This rank's piece of the full tensor `x` along `dim` (a view where the rank holds one run)."""
        return sharding.shard(self, x, group, dim)

    def unshard(self, x_local: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
        """The full tensor in original token order (all-gather; gradients flow back to shards)."""
        return sharding.unshard(self, x_local, group, dim)

    # ---- identity ------------------------------------------------------------------------
    def spec(self) -> str:
        """A string that names this layout exactly (configs, error messages, custom-op arguments).
        `dim` (placement use only, see dtcp/frontends/dtensor.py) is not part of it."""
        return self.name

    def __repr__(self) -> str:
        # Leave `dim` out while unset, so messages read "Zigzag()".
        args = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if not (f.name == "dim" and self.dim is None)
        ]
        return f"{type(self).__name__}({', '.join(args)})"

    def _check_dim(self) -> None:
        dim = getattr(self, "dim", None)
        if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
            raise TypeError(f"{type(self).__name__}(dim=...) must be an int (the tensor dim it splits) or None; got {dim!r}")


@lru_cache(maxsize=256)
def positions_of(layout: Layout, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Cached, read-only: never hand it out without a copy (keyed by the layout's value)."""
    runs = layout.runs(seq_len, world_size, rank)
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in runs])


def check_boundaries(cu: "list[int] | tuple[int, ...]", fix: str) -> None:
    """Document boundaries must start at 0 and never decrease (repeated values are empty
    documents); raise a ValueError starting with `fix` otherwise."""
    if len(cu) < 2:
        raise ValueError(f"{fix}; got {len(cu)} value(s). One document: torch.tensor([0, S], dtype=torch.int32)")
    if cu[0] != 0:
        raise ValueError(f"{fix}; it starts at {cu[0]}, not 0")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{fix}; it decreases at index {i} ({cu[i - 1]} -> {cu[i]})")


def documents_tensor(doc_lens, owner: str) -> torch.Tensor:
    """The int32 boundaries (0, c1, ..., S) of the documents `doc_lens` of a layout that carries
    them (`owner`: its class name, for errors), checked: a tuple of non-negative ints, not all
    zero. Its length (documents + 1) changes from batch to batch: marked so, torch.compile traces
    it symbolic from the first batch on (no recompile when the number of documents changes)."""
    if not isinstance(doc_lens, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in doc_lens):
        raise TypeError(f"{owner}(doc_lens) takes a tuple of non-negative ints; got {doc_lens!r}")
    if sum(doc_lens) == 0:
        raise ValueError(f"{owner} needs at least one non-empty document")
    bounds = [0]
    for n in doc_lens:
        bounds.append(bounds[-1] + n)
    return mark_length_dynamic(torch.tensor(bounds, dtype=torch.int32))


def documents_of(cu_seqlens, owner: str) -> tuple[int, ...]:
    """Document lengths from boundaries (a list or an int tensor, 0 = c0 <= ... <= cn = S), checked."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    check_boundaries(cu, f"{owner}: cu_seqlens must be the boundaries of the packed documents, 0 = c0 <= c1 <= ... <= cn")
    return tuple(b - a for a, b in zip(cu, cu[1:]))


def check_window(window, what: str = "window_size") -> tuple[int, int]:
    """A validated (left, right) window: ints >= -1, -1 meaning unbounded (flash-attn's convention:
    query i sees keys i - left .. i + right)."""
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(
            f"{what} must be a pair of ints (left, right) as in flash-attn, -1 meaning unbounded, "
            f"e.g. (4096, 0) for a causal sliding window of 4096; got {window!r}"
        )
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"{what} entries must be >= 0, or -1 for unbounded; got {tuple(window)}")
    return int(left), int(right)
