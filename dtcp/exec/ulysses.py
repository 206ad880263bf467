"""The head exchange of Ulysses and hybrid context parallelism, on plain tensors.

`to_heads` turns sequence shards into head shards: each tensor (B, H, L, E) of this rank's L
tokens becomes (B, h, U*L, E), the U ranks' tokens in the order the attention after the exchange
needs (plan/ulysses.py's pieces) for this rank's h heads. `to_sequence` is the way back. Several
tensors travel in one all-to-all: their per-destination parts are laid side by side in one byte
buffer (each part 16-byte aligned), so tensors of different dtypes (out and its float32 lse, or
bf16 dQ and float32 dK/dV) share the call.

Buffers, per call: one send and one receive buffer of every tensor's size (the all-to-all's own),
and the gathered tensors. The input is read once into the send buffer (a strided copy that also
does the head split) and the gathered tensors are written once from the receive buffer (the
reordering is in the same copy).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..comm.collectives import all_to_all_bytes
from ..plan.ulysses import HeadSplit, UlyssesPlan
from .allgather import bounded_put

_ALIGN = 16
_INDEXED_PIECES = 32  # more pieces than this (striped layouts): one indexed copy instead of one per piece


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(parts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of each part (shape per destination, dtype) in a row, and the row length."""
    offsets, row = [], 0
    for shape, dtype in parts:
        offsets.append(row)
        row += _aligned(math.prod(shape) * dtype.itemsize)
    return offsets, row


def _part(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View of one part across all rows of a (U, row) uint8 buffer: (U, *shape) in `dtype`."""
    size = math.prod(shape) * dtype.itemsize
    return buffer[:, offset:offset + size].view(dtype).view((buffer.shape[0],) + tuple(shape))


def _token_index(plan: UlyssesPlan, device: torch.device) -> torch.Tensor:
    """(U*L,) int64: gathered position g <- position index[g] of the rank-major sequence."""
    index = torch.empty(plan.gathered_len, dtype=torch.int64)
    for j, src, dst, n in plan.pieces:
        index[dst:dst + n] = torch.arange(j * plan.local_len + src, j * plan.local_len + src + n)
    return index.to(device)


_INDEX_CACHE: dict = {}


def _cached_index(plan: UlyssesPlan, device: torch.device) -> torch.Tensor:
    key = (plan.pieces, plan.local_len, plan.world_size, device)
    index = _INDEX_CACHE.get(key)
    return index if index is not None else bounded_put(_INDEX_CACHE, key, _token_index(plan, device))


def _copy_head_split(dest: torch.Tensor, x: torch.Tensor, split: HeadSplit) -> None:
    """dest (U, B, h, L, E) <- x (B, H, L, E), what each destination rank gets: heads
    [u*h, (u+1)*h), or, for K/V heads fewer than ranks, head u // replicas (broadcast)."""
    if split.replicas == 1:
        dest.copy_(x.unflatten(1, (dest.shape[0], split.per_rank)).movedim(1, 0))
    else:  # (Hkv, replicas, B, 1, L, E) <- (Hkv, 1, B, 1, L, E)
        dest.unflatten(0, (split.heads, split.replicas)).copy_(x.movedim(1, 0)[:, None, :, None])


def to_heads(tensors: Sequence[tuple[torch.Tensor, HeadSplit]], plan: UlyssesPlan, pg) -> list[torch.Tensor]:
    """Sequence shards -> head shards, in one all-to-all.

    tensors: (x, split) pairs, x (B, H, L, E) this rank's tokens (any strides, any dtype).
    Returns, per tensor, (B, h, U*L, E) contiguous in x's dtype: this rank's h = split.per_rank
    heads (from split.first_head(rank)) for the group's tokens in plan order."""
    u_size, l_len = plan.world_size, plan.local_len
    parts = [((x.shape[0], split.per_rank, l_len, x.shape[3]), x.dtype) for x, split in tensors]
    offsets, row = _layout(parts)
    device = tensors[0][0].device
    send = torch.empty((u_size, row), dtype=torch.uint8, device=device)
    for (x, split), offset, (shape, dtype) in zip(tensors, offsets, parts):
        _copy_head_split(_part(send, offset, shape, dtype), x, split)
    recv = all_to_all_bytes(send, pg, u_size)
    del send
    out = []
    for offset, (shape, dtype) in zip(offsets, parts):
        got = _part(recv, offset, shape, dtype)  # (U, B, h, L, E): dim 0 = the rank whose tokens these are
        b, h, _, e = shape
        gathered = torch.empty((b, h, plan.gathered_len, e), dtype=dtype, device=device)
        if plan.in_order:
            gathered.unflatten(2, (u_size, l_len)).copy_(got.permute(1, 2, 0, 3, 4))
        elif len(plan.pieces) <= _INDEXED_PIECES:
            for j, src, dst, n in plan.pieces:
                gathered[:, :, dst:dst + n].copy_(got[j, :, :, src:src + n])
        else:
            rank_major = got.permute(1, 2, 0, 3, 4).reshape(b, h, plan.gathered_len, e)
            torch.index_select(rank_major, 2, _cached_index(plan, device), out=gathered)
        out.append(gathered)
    return out


def to_sequence(tensors: Sequence[tuple[torch.Tensor, HeadSplit, torch.dtype]], plan: UlyssesPlan, pg,
                sum_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Head shards -> sequence shards, in one all-to-all (the inverse of to_heads).

    tensors: (x, split, dtype), x (B, h, U*L, E) this rank's heads over the group's tokens. Each
    travels in `dtype`, except replicated K/V heads' gradients, which travel in `sum_dtype` (the
    replicas are summed here: in float32 for half inputs). Returns, per tensor, (B, H, L, E)
    contiguous in `dtype`."""
    u_size, l_len = plan.world_size, plan.local_len
    wire = [sum_dtype if (split.replicas > 1 and sum_dtype is not None) else dtype for _, split, dtype in tensors]
    parts = [((x.shape[0], split.per_rank, l_len, x.shape[3]), w) for (x, split, _), w in zip(tensors, wire)]
    offsets, row = _layout(parts)
    device = tensors[0][0].device
    send = torch.empty((u_size, row), dtype=torch.uint8, device=device)
    for (x, _, _), offset, (shape, dtype) in zip(tensors, offsets, parts):
        dest = _part(send, offset, shape, dtype)  # (U, B, h, L, E): dim 0 = the rank whose tokens these are
        if plan.in_order:
            dest.copy_(x.unflatten(2, (u_size, l_len)).permute(2, 0, 1, 3, 4))
        elif len(plan.pieces) <= _INDEXED_PIECES:
            for j, src, dst, n in plan.pieces:
                dest[j, :, :, src:src + n].copy_(x[:, :, dst:dst + n])
        else:
            b, h, _, e = shape
            # rank-major position of each gathered token: scatter them back in one copy
            rank_major = torch.empty((b, h, plan.gathered_len, e), dtype=x.dtype, device=device)
            rank_major.index_copy_(2, _cached_index(plan, device), x)
            dest.copy_(rank_major.unflatten(2, (u_size, l_len)).permute(2, 0, 1, 3, 4))
    recv = all_to_all_bytes(send, pg, u_size)
    del send
    out = []
    for (x, split, dtype), offset, (shape, w) in zip(tensors, offsets, parts):
        got = _part(recv, offset, shape, w)  # (U, B, h, L, E): dim 0 = the rank whose heads these are
        b, _, _, e = shape
        if split.replicas == 1:
            result = torch.empty((b, split.heads, l_len, e), dtype=dtype, device=device)
            result.unflatten(1, (u_size, split.per_rank)).copy_(got.movedim(0, 1))
        else:
            # (Hkv * replicas, B, 1, L, E): sum each head's replicas
            summed = got.view(split.heads, split.replicas, b, l_len, e).sum(1)
            result = torch.empty((b, split.heads, l_len, e), dtype=dtype, device=device)
            result.copy_(summed.movedim(0, 1))
        out.append(result)
    return out
