"""The head exchange of Ulysses and hybrid context parallelism, on plain tensors.

`to_heads` turns sequence shards into head shards: each tensor (B, H, L, E) of this rank's L
tokens becomes (B, h, U*L, E), the U ranks' tokens in the order the attention after the exchange
needs (plan/ulysses.py's pieces) for this rank's h heads. `to_sequence` is the way back. Several
tensors travel in one all-to-all: their per-destination parts are laid side by side in one byte
buffer, so tensors of different dtypes (out and its float32 lse, or bf16 dQ and float32 dK/dV)
share the call.

Each part travels token-major, (B, L, h, E): one row of h*E elements per token. Every part's
offset, and the buffer's row per destination, are multiples of the part's token row, so the
whole receive buffer reads as one array of a tensor's token rows, whichever rank sent them. The
tokens then go in the attention's order with one `index_select` over those rows (a gather of
rows of a few hundred bytes to a few KB, near the device's copy bandwidth), whatever the pieces:
documents placed whole by `Balanced` make dozens to hundreds of pieces, which a copy per piece,
or a rank-major copy and then a reordering one, paid for in launches or in a second pass. The
gathered tensors come out token-major, (B, U*L, h, E) in memory viewed as (B, h, U*L, E), the
layout a varlen kernel reads. On the way back each destination's rows are gathered the same way
(one `index_select` per destination rank) straight into the send buffer.

Buffers, per call: one send and one receive buffer of every tensor's size (the all-to-all's own),
and the gathered tensors. The input is read once into the send buffer (a strided copy that also
does the head split) and the gathered tensors are written once from the receive buffer.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..comm.collectives import all_to_all_bytes
from ..plan.ulysses import HeadSplit, UlyssesPlan
from .allgather import bounded_put

_ALIGN = 16


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one token's row of a part (B, L, h, E): h * E elements."""
    return shape[2] * shape[3] * dtype.itemsize


def _layout(parts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of each part (shape (B, L, h, E) per destination, dtype) in a row, and the row
    length. Each offset is a multiple of its part's token row (and of 16 bytes), and so is the
    row, so that the buffer reads as rows of any part's tokens across every destination."""
    offsets, row, unit = [], 0, _ALIGN
    for shape, dtype in parts:
        step = math.lcm(_ALIGN, _row_bytes(shape, dtype))
        row = -(-row // step) * step
        offsets.append(row)
        row += math.prod(shape) * dtype.itemsize
        unit = math.lcm(unit, step)
    return offsets, -(-row // unit) * unit


def _part(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View of one part across all rows of a (U, row) uint8 buffer: (U, *shape) in `dtype`."""
    size = math.prod(shape) * dtype.itemsize
    return buffer[:, offset:offset + size].view(dtype).view((buffer.shape[0],) + tuple(shape))


def _token_rows(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole (U, row) uint8 buffer as token rows of a part of `shape` (B, L, h, E):
    (U * row / row_bytes, h, E) in `dtype` (the layout makes row_bytes divide everything)."""
    return buffer.view(-1).view(dtype).view(-1, shape[2], shape[3])


_INDEX_CACHE: dict = {}
# Indices kept, at most: a plan (a document structure) takes one per tensor set it exchanges (q,
# k, v; dout; the way back), and a new structure every batch would otherwise keep each batch's.
_CACHED = 32


def _gather_index(plan: UlyssesPlan, batch: int, first_row: int, rows_per_rank: int,
                  device: torch.device) -> torch.Tensor:
    """(B * U*L,) int64 for `to_heads`: gathered token g of batch row b <- token row
    first_row + j * rows_per_rank + b * L + l of the receive buffer, where rank j's local token l
    is gathered token g (the plan's pieces). Cached by value."""
    key = ("gather", plan.pieces, plan.local_len, plan.world_size, batch, first_row, rows_per_rank, device)
    index = _INDEX_CACHE.get(key)
    if index is not None:
        return index
    l_len, total = plan.local_len, plan.gathered_len
    index = torch.empty((batch, total), dtype=torch.int64)
    for j, src, dst, n in plan.pieces:
        start = first_row + j * rows_per_rank + src
        index[:, dst:dst + n] = torch.arange(start, start + n) + torch.arange(batch)[:, None] * l_len
    return bounded_put(_INDEX_CACHE, key, index.view(-1).to(device), _CACHED)


def _scatter_index(plan: UlyssesPlan, batch: int, device: torch.device) -> torch.Tensor:
    """(U, B * L) int64 for `to_sequence`: destination rank j's local token l of batch row b is
    gathered token row b * U*L + g (the plan's pieces, the other way round). Cached by value."""
    key = ("scatter", plan.pieces, plan.local_len, plan.world_size, batch, device)
    index = _INDEX_CACHE.get(key)
    if index is not None:
        return index
    l_len, total = plan.local_len, plan.gathered_len
    index = torch.empty((plan.world_size, batch, l_len), dtype=torch.int64)
    for j, src, dst, n in plan.pieces:
        index[j, :, src:src + n] = torch.arange(dst, dst + n) + torch.arange(batch)[:, None] * total
    return bounded_put(_INDEX_CACHE, key, index.view(plan.world_size, -1).to(device), _CACHED)


def _copy_head_split(dest: torch.Tensor, x: torch.Tensor, split: HeadSplit) -> None:
    """dest (U, B, L, h, E) <- x (B, H, L, E), what each destination rank gets, token-major: heads
    [u*h, (u+1)*h), or, for K/V heads fewer than ranks, head u // replicas (broadcast)."""
    if split.replicas == 1:
        dest.copy_(x.unflatten(1, (dest.shape[0], split.per_rank)).permute(1, 0, 3, 2, 4))
    else:  # (Hkv, replicas, B, L, 1, E) <- (Hkv, 1, B, L, 1, E)
        dest.unflatten(0, (split.heads, split.replicas)).copy_(x.permute(1, 0, 2, 3)[:, None, :, :, None])


def to_heads(tensors: Sequence[tuple[torch.Tensor, HeadSplit]], plan: UlyssesPlan, pg) -> list[torch.Tensor]:
    """Sequence shards -> head shards, in one all-to-all.

    tensors: (x, split) pairs, x (B, H, L, E) this rank's tokens (any strides, any dtype).
    Returns, per tensor, (B, h, U*L, E) in x's dtype, token-major (a (B, U*L, h, E) contiguous
    tensor transposed): this rank's h = split.per_rank heads (from split.first_head(rank)) for the
    group's tokens in plan order."""
    u_size, l_len = plan.world_size, plan.local_len
    parts = [((x.shape[0], l_len, split.per_rank, x.shape[3]), x.dtype) for x, split in tensors]
    offsets, row = _layout(parts)
    device = tensors[0][0].device
    send = torch.empty((u_size, row), dtype=torch.uint8, device=device)
    for (x, split), offset, (shape, dtype) in zip(tensors, offsets, parts):
        _copy_head_split(_part(send, offset, shape, dtype), x, split)
    recv = all_to_all_bytes(send, pg, u_size)
    del send
    out = []
    for offset, (shape, dtype) in zip(offsets, parts):
        b, _, h, e = shape
        row_bytes = _row_bytes(shape, dtype)
        index = _gather_index(plan, b, offset // row_bytes, row // row_bytes, device)
        gathered = _token_rows(recv, shape, dtype).index_select(0, index)  # (B * U*L, h, E)
        out.append(gathered.view(b, plan.gathered_len, h, e).transpose(1, 2))
    return out


def to_sequence(tensors: Sequence[tuple[torch.Tensor, HeadSplit, torch.dtype]], plan: UlyssesPlan, pg,
                sum_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Head shards -> sequence shards, in one all-to-all (the inverse of to_heads).

    tensors: (x, split, dtype), x (B, h, U*L, E) this rank's heads over the group's tokens (any
    strides). Each travels in `dtype`, except replicated K/V heads' gradients, which travel in
    `sum_dtype` (the replicas are summed here: in float32 for half inputs). Returns, per tensor,
    (B, H, L, E) contiguous in `dtype`."""
    u_size, l_len = plan.world_size, plan.local_len
    wire = [sum_dtype if (split.replicas > 1 and sum_dtype is not None) else dtype for _, split, dtype in tensors]
    parts = [((x.shape[0], l_len, split.per_rank, x.shape[3]), w) for (x, split, _), w in zip(tensors, wire)]
    offsets, row = _layout(parts)
    device = tensors[0][0].device
    send = torch.empty((u_size, row), dtype=torch.uint8, device=device)
    for (x, _, _), offset, (shape, w) in zip(tensors, offsets, parts):
        dest = _part(send, offset, shape, w)  # (U, B, L, h, E): dim 0 = the rank whose tokens these are
        b, _, h, e = shape
        tokens = x.transpose(1, 2)  # (B, U*L, h, E)
        if plan.in_order and not tokens.is_contiguous():
            dest.copy_(tokens.unflatten(1, (u_size, l_len)).movedim(1, 0))  # one strided copy, any dtype
            continue
        # each destination's token rows gathered straight into its part of the send buffer
        rows = tokens.to(w).contiguous().view(-1, h, e)
        index = _scatter_index(plan, b, device)
        for j in range(u_size):
            torch.index_select(rows, 0, index[j], out=dest[j].view(-1, h, e))
    recv = all_to_all_bytes(send, pg, u_size)
    del send
    out = []
    for (x, split, dtype), offset, (shape, w) in zip(tensors, offsets, parts):
        got = _part(recv, offset, shape, w)  # (U, B, L, h, E): dim 0 = the rank whose heads these are
        b, _, _, e = shape
        result = torch.empty((b, split.heads, l_len, e), dtype=dtype, device=device)
        if split.replicas == 1:
            result.unflatten(1, (u_size, split.per_rank)).copy_(got.permute(1, 0, 3, 2, 4))
        else:
            # (Hkv * replicas, B, L, 1, E): sum each head's replicas
            summed = got.view(split.heads, split.replicas, b, l_len, e).sum(1)
            result.copy_(summed.movedim(0, 1))
        out.append(result)
    return out
