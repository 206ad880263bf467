"""Sequence layouts: which global tokens each rank of a context-parallel group holds.

A layout is pure index math over (seq_len, world_size, rank). Every layout here keeps the
tokens of one rank in increasing global order, so "key j is not after query i" in global
positions is the same as "j <= i" in local indices when both come from the same rank. The
schedule relies on that.

Pictures for S = 16 tokens, N = 2 ranks (digits are global token positions):

    Contiguous()        rank 0: 0 1 2 3 4 5 6 7          rank 1: 8 9 10 11 12 13 14 15
    Zigzag()            rank 0: 0 1 2 3 | 12 13 14 15    rank 1: 4 5 6 7 | 8 9 10 11
    Striped(block=1)    rank 0: 0 2 4 6 8 10 12 14       rank 1: 1 3 5 7 9 11 13 15
    Striped(block=2)    rank 0: 0 1 4 5 8 9 12 13        rank 1: 2 3 6 7 10 11 14 15
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from ._groups import GroupLike, group_rank, group_size, resolve_group


class Layout:
    """Base class. Subclasses define `runs`, the global token runs a rank holds, in local order."""

    #: short name used in specs, configs and error messages
    name: str = "layout"

    # ---- pure index math -------------------------------------------------------------
    def multiple(self, world_size: int) -> int:
        """The sequence length must be a multiple of this."""
        raise NotImplementedError

    def runs(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """Half-open global ranges [start, end) held by `rank`, in local order."""
        raise NotImplementedError

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
        return _positions_cached(self, seq_len, world_size, rank).clone()

    def permutation(self, seq_len: int, world_size: int) -> torch.Tensor:
        """Global positions of all ranks' tokens, rank 0's first: gathering shards gives x[perm]."""
        return torch.cat([self.global_positions(seq_len, world_size, r) for r in range(world_size)])

    # ---- tensors -----------------------------------------------------------------------
    def positions(self, seq_len: int, group: GroupLike = None) -> torch.Tensor:
        """Global positions of this rank's tokens, in local order (feed these to RoPE)."""
        pg = resolve_group(group)
        return self.global_positions(seq_len, group_size(pg), group_rank(pg))

    def shard(self, x: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
        """This rank's piece of the full tensor `x` along `dim`."""
        pg = resolve_group(group)
        n, r = group_size(pg), group_rank(pg)
        dim = dim % x.dim()
        self.check(x.shape[dim], n)
        runs = self.runs(x.shape[dim], n, r)
        if len(runs) == 1:
            return x.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        return x.index_select(dim, _positions_on(self, x.shape[dim], n, r, x.device))

    def unshard(self, x_local: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
        """The full tensor in original token order (all-gather; gradients flow back to shards)."""
        pg = resolve_group(group)
        n = group_size(pg)
        dim = dim % x_local.dim()
        gathered = _AllGatherCat.apply(x_local, pg, dim)  # rank-major order
        inv = torch.argsort(self.permutation(x_local.shape[dim] * n, n))
        return gathered.index_select(dim, inv.to(x_local.device))

    # ---- identity ------------------------------------------------------------------------
    def spec(self) -> str:
        """A string that names this layout exactly (travels through custom ops and configs).
        `dim` (placement use only, see dtcp/dtensor.py) is not part of it."""
        return self.name

    def __repr__(self) -> str:
        # Leave `dim` out while unset, so messages read "Zigzag()" as before.
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
def _positions_cached(layout: Layout, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    runs = layout.runs(seq_len, world_size, rank)
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in runs])


_DEVICE_POSITIONS: dict = {}


def _positions_on(layout: Layout, seq_len: int, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
    """_positions_cached on `device`, copied there once: a copy from pageable host memory to a GPU
    waits for the GPU to finish its queued work, and `shard` runs on every training step (read
    only: never hand it out to callers)."""
    key = (layout, seq_len, world_size, rank, device)
    idx = _DEVICE_POSITIONS.get(key)
    if idx is None:
        if len(_DEVICE_POSITIONS) >= 256:
            _DEVICE_POSITIONS.clear()
        idx = _DEVICE_POSITIONS[key] = _positions_cached(layout, seq_len, world_size, rank).to(device)
    return idx


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
        c = seq_len // (2 * world_size)
        hi = 2 * world_size - 1 - rank
        return [(rank * c, (rank + 1) * c), (hi * c, (hi + 1) * c)]


@dataclass(frozen=True, repr=False)
class Striped(Layout):
    """Blocks of `block` tokens dealt round-robin: block i goes to rank i mod N."""

    block: int = 1
    #: the tensor dim it splits, when used as a DTensor placement (dtcp.distribute_tensor); else None
    dim: Optional[int] = dataclasses.field(default=None, kw_only=True)
    name = "striped"

    def __post_init__(self):
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Striped(block=...) must be a positive int; got {self.block!r}")
        self._check_dim()

    def multiple(self, world_size: int) -> int:
        return world_size * self.block

    def runs(self, seq_len, world_size, rank):
        b = self.block
        return [(i * b, (i + 1) * b) for i in range(rank, seq_len // b, world_size)]

    def spec(self) -> str:
        return f"striped:{self.block}"


def check_window(window, what: str = "window_size") -> tuple[int, int]:
    """A validated (left, right) window: ints >= -1, -1 meaning unbounded."""
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


@dataclass(frozen=True)
class DocZigzag(Layout):
    """Per-document zigzag for causal attention over packed documents (load balance).

    Each document is padded at its end to a multiple of 2N and cut into 2N equal chunks; rank r
    holds chunk r and chunk 2N-1-r of every document, documents in order. Every rank then has
    the same causal work in every document. The layout carries the documents, so
    `ring_attention(..., layout=DocZigzag(...))` applies the document mask by itself; padding
    tokens see nothing and are seen by nobody (out 0, lse 0, zero gradients).

    The tensors it shards are *padded*: use `shard_packed` (packed tokens -> this rank's padded
    shard), `loss_mask` (True on real tokens: multiply the loss by it) and `unshard_packed`.
    Picture, N = 2, documents of 5 and 3 tokens (p = padding; chunks of 2 and 1):

        padded:  a0 a1 a2 a3 a4 p p p | b0 b1 b2 p
        rank 0:  a0 a1 . p p  | b0 . p        rank 1:  a2 a3 . a4 p | b1 . b2
    """

    doc_lens: tuple[int, ...] = ()
    name = "doczigzag"

    def __post_init__(self):
        if not isinstance(self.doc_lens, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.doc_lens
        ):
            raise TypeError(f"DocZigzag(doc_lens) takes a tuple of non-negative ints; got {self.doc_lens!r}")
        if sum(self.doc_lens) == 0:
            raise ValueError("DocZigzag needs at least one non-empty document")

    @staticmethod
    def from_cu_seqlens(cu_seqlens) -> "DocZigzag":
        """From global boundaries of the packed (unpadded) sequence: a list or an int tensor."""
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be 0 = c0 <= c1 <= ... <= cn (document boundaries); got {cu}")
        return DocZigzag(tuple(b - a for a, b in zip(cu, cu[1:])))

    def _padded(self, world_size: int) -> list[tuple[int, int, int]]:
        """(padded start, real length, padded length) per non-empty document."""
        m, out, start = 2 * world_size, [], 0
        for n in self.doc_lens:
            if n:
                p = -(-n // m) * m
                out.append((start, n, p))
                start += p
        return out

    def padded_len(self, world_size: int) -> int:
        """Length of the padded sequence over `world_size` ranks."""
        return sum(p for _, _, p in self._padded(world_size))

    def multiple(self, world_size: int) -> int:
        return 2 * world_size

    def check(self, seq_len: int, world_size: int) -> None:
        want = self.padded_len(world_size)
        if seq_len != want:
            raise ValueError(
                f"DocZigzag over {world_size} ranks holds a padded sequence of {want} tokens "
                f"({want // world_size} per rank); got {seq_len}. Shard the packed tensor with "
                "layout.shard_packed(x, group, dim)"
            )

    def runs(self, seq_len, world_size, rank):
        runs = []
        for start, _, p in self._padded(world_size):
            c = p // (2 * world_size)
            hi = 2 * world_size - 1 - rank
            runs += [(start + rank * c, start + (rank + 1) * c), (start + hi * c, start + (hi + 1) * c)]
        return runs

    def segments(self, world_size: int) -> tuple[tuple[int, int], ...]:
        """The real tokens of each document in padded positions; the rest is padding."""
        return tuple((start, start + n) for start, n, _ in self._padded(world_size))

    def spec(self) -> str:
        return "doczigzag:" + ",".join(str(n) for n in self.doc_lens)

    # ---- packed <-> padded ------------------------------------------------------------------
    def _real_positions(self, world_size: int) -> torch.Tensor:
        """Padded position of each packed token."""
        return torch.cat([torch.arange(a, a + n) for a, n, _ in self._padded(world_size)])

    def pad(self, x: torch.Tensor, world_size: int, dim: int = 0) -> torch.Tensor:
        """Packed (..., T, ...) -> padded (..., S_padded, ...), zeros in the padding."""
        dim = dim % x.dim()
        if x.shape[dim] != sum(self.doc_lens):
            raise ValueError(f"pad: dim {dim} has {x.shape[dim]} tokens; the documents hold {sum(self.doc_lens)}")
        shape = list(x.shape)
        shape[dim] = self.padded_len(world_size)
        out = x.new_zeros(shape)
        return out.index_copy(dim, self._real_positions(world_size).to(x.device), x)

    def shard_packed(self, x: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
        """This rank's shard of the padded sequence, from the full packed tensor."""
        pg = resolve_group(group)
        return self.shard(self.pad(x, group_size(pg), dim), pg, dim)

    def loss_mask(self, group: GroupLike = None) -> torch.Tensor:
        """(S_local,) bool: True on this rank's real tokens, False on padding."""
        pg = resolve_group(group)
        n = group_size(pg)
        real = torch.zeros(self.padded_len(n), dtype=torch.bool)
        real[self._real_positions(n)] = True
        return real[self.positions(self.padded_len(n), pg)]

    def unshard_packed(self, x_local: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
        """The full packed tensor (..., T, ...) from every rank's padded shard (differentiable)."""
        pg = resolve_group(group)
        full = self.unshard(x_local, pg, dim)
        return full.index_select(dim % full.dim(), self._real_positions(group_size(pg)).to(full.device))


def layout_from_spec(spec: "str | Layout") -> Layout:
    """Inverse of `Layout.spec()`; also accepts a Layout and returns it."""
    if isinstance(spec, Layout):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"layout must be a dtcp Layout or its name; got {type(spec).__name__}")
    name, _, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "contiguous":
        return Contiguous()
    if name == "zigzag":
        return Zigzag()
    if name == "striped":
        return Striped(int(arg) if arg else 1)
    if name == "doczigzag":
        return DocZigzag(tuple(int(n) for n in arg.split(",") if n))
    if name == "window":
        left, _, right = arg.partition(":")
        return SlidingWindow(int(left), int(right) if right else 0)
    raise ValueError(f"unknown layout {spec!r}; use 'contiguous', 'zigzag', 'striped[:block]' or 'window:left[:right]'")


class _AllGatherCat(torch.autograd.Function):
    """Concatenate every rank's tensor along `dim` (rank-major). Backward: sum the incoming
    gradients over ranks (all-reduce) and keep this rank's slice. Works on gloo and NCCL."""

    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        n = group_size(pg)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=pg)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # gloo needs contiguous buffers
        dist.all_reduce(grad, group=ctx.pg)
        n, r = group_size(ctx.pg), group_rank(ctx.pg)
        m = grad.shape[ctx.dim] // n
        return grad.narrow(ctx.dim, r * m, m).contiguous(), None, None
