"""The head exchange of Ulysses and hybrid context parallelism (pure Python over integers).

Ulysses trades tokens for heads inside a group of U ranks: one all-to-all turns each rank's
(B, H, L, D) shard of the sequence into (B, H/U, U*L, D), all of the group's tokens for H/U heads;
attention runs on that; a second all-to-all turns the output back. On a 1-D group of N ranks,
U = N and the attention after the exchange is local attention over the whole sequence. On a 2-D
mesh (hybrid), U is the Ulysses dim and the attention after the exchange is a ring (or all-gather)
across the R = N / U groups, over `Grouped(layout, U)`.

`HeadSplit` says how one tensor's heads are dealt: rank u gets heads [u*h, (u+1)*h) with
h = H / U. K/V with fewer heads than ranks (GQA, Hkv < U, U a multiple of Hkv) are replicated only
as far as needed: rank u gets K/V head u // (U / Hkv), the one its query heads use, and the
gradients of the replicas are summed on the way back.

`pieces` say where the gathered tokens go: the exchange delivers the U shards rank after rank,
and attention needs them in the grouped layout's order (increasing global position). Piece
(j, src, dst, n): tokens [src, src + n) of rank j's shard go to [dst, dst + n) of the gathered
sequence. The pieces tile both sides; the backward uses them the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layouts import Contiguous, Layout
from ..layouts.grouped import Grouped


@dataclass(frozen=True)
class HeadSplit:
    """One tensor's heads over the U ranks of a head group."""

    heads: int  # H of the tensor
    per_rank: int  # heads each rank gets
    replicas: int = 1  # ranks that get the same head (> 1 only for K/V heads fewer than ranks)

    def first_head(self, rank: int) -> int:
        return rank // self.replicas * self.per_rank


@dataclass(frozen=True)
class UlyssesPlan:
    """One rank's head exchange (see the module docstring)."""

    world_size: int  # U, the head group's size
    rank: int  # u, this rank's place in it
    local_len: int  # L, tokens per rank before the exchange
    q: HeadSplit
    kv: HeadSplit
    pieces: tuple[tuple[int, int, int, int], ...]  # (rank j, src start, dst start, length)

    @property
    def gathered_len(self) -> int:
        return self.world_size * self.local_len

    @property
    def in_order(self) -> bool:
        """Do the shards arrive in the right order as they are (no reordering copy needed)?"""
        return all(src == 0 and dst == j * self.local_len and n == self.local_len for j, src, dst, n in self.pieces)


def head_splits(q_heads: int, kv_heads: int, group_size: int, what: str) -> tuple[HeadSplit, HeadSplit]:
    """(q split, kv split) of Hq query and Hkv key/value heads over a head group of U ranks, or a
    ValueError naming the fix. `what` names the strategy in messages."""
    u = group_size
    if q_heads % u:
        raise ValueError(
            f"{what} deals the {q_heads} query heads over the {u} ranks of its head group: {q_heads} is not a "
            f"multiple of {u}. Use strategy='ring' or 'allgather', or a hybrid mesh whose Ulysses degree divides "
            f"{q_heads}"
        )
    q = HeadSplit(q_heads, q_heads // u)
    if kv_heads % u == 0:
        return q, HeadSplit(kv_heads, kv_heads // u)
    if u % kv_heads == 0:
        return q, HeadSplit(kv_heads, 1, u // kv_heads)  # GQA with fewer K/V heads than ranks
    raise ValueError(
        f"{what} deals the {kv_heads} key/value heads over the {u} ranks of its head group: neither divides the "
        f"other. Use strategy='ring' or 'allgather', or a hybrid mesh whose Ulysses degree divides {kv_heads} "
        f"(or is a multiple of it)"
    )


def inner_layout(layout: Layout, group_size: int, outer_size: int) -> Layout:
    """The layout the attention after the exchange sees, over the `outer_size` head groups: the
    whole sequence in order for one group, else `Grouped(layout, group_size)`."""
    return Contiguous() if outer_size == 1 else Grouped(layout, group_size)


@lru_cache(maxsize=256)
def ulysses_plan(layout: Layout, local_len: int, group_size: int, outer_size: int, cp_rank: int,
                 q_heads: int, kv_heads: int, what: str = "strategy='ulysses'") -> UlyssesPlan:
    """The head exchange of CP rank `cp_rank` = outer rank * U + u, over N = U * R ranks of
    `layout` holding `local_len` tokens each. Cached by value."""
    u_size, n = group_size, group_size * outer_size
    seq_len = local_len * n
    q, kv = head_splits(q_heads, kv_heads, u_size, what)
    outer, u = divmod(cp_rank, u_size)
    # (global start, rank j, offset in j's shard, length) for every run of the group's shards
    runs = []
    for j in range(u_size):
        offset = 0
        for a, b in layout.runs(seq_len, n, outer * u_size + j):
            runs.append((a, j, offset, b - a))
            offset += b - a
    runs.sort()
    pieces: list[list[int]] = []
    dst = 0
    for _, j, src, length in runs:
        last = pieces[-1] if pieces else None
        if last is not None and last[0] == j and last[1] + last[3] == src:
            last[3] += length  # continues the previous piece on both sides
        else:
            pieces.append([j, src, dst, length])
        dst += length
    # The gathered tokens, in order, must be exactly the inner layout's shard of this group.
    inner = inner_layout(layout, u_size, outer_size)
    want = inner.runs(seq_len, outer_size, outer)
    got = Grouped(layout, u_size).runs(seq_len, outer_size, outer)
    if got != want:  # pragma: no cover - Grouped is exact for every layout; a guard for new ones
        raise AssertionError(f"{layout!r}: the tokens of head group {outer} are {got}, not {inner!r}'s {want}")
    return UlyssesPlan(u_size, u, local_len, q, kv, tuple(tuple(p) for p in pieces))
