"""Packed documents: `cu_seqlens` values -> per-row document boundaries and segments, checked once.

`cu_seqlens` are the global document boundaries of the packed sequence (0 = c0 <= ... <= cn = S),
the same documents in every batch row; or, for a batch of B > 1 rows with their own documents,
the boundaries over the batch flattened row-major (0 ... B*S, a boundary at every row start b*S:
torchtitan's and flash-attn's packed batches). Repeated boundaries (empty documents) are allowed,
as in cu_seqlens padded to a fixed size.
"""

from __future__ import annotations

from ..layouts.base import check_boundaries

_FIX = "cu_seqlens must be the global document boundaries of the packed sequence: 0 = c0 <= c1 <= ... <= cn = S"


def segments_from_cu_seqlens(cu: tuple[int, ...], seq_len: int, batch: int = 1) -> tuple[tuple[int, int], ...]:
    """Document ranges [start, end) from cumulative lengths, empty documents dropped; checks them."""
    check_boundaries(cu, _FIX)
    if cu[-1] != seq_len:
        per_row = f" (or B*S = {batch * seq_len}, each batch row with its own documents)" if batch > 1 else ""
        raise ValueError(
            f"{_FIX}{per_row}; it ends at {cu[-1]} but the sequence has S = {seq_len} tokens (S_local x world "
            "size). Pass the boundaries of the whole packed sequence, not of this rank's shard"
        )
    return tuple((a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a)


def chunk_segments(segments, seq_len: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
    """Chunked attention (Llama 4's ``attention_chunk_size``): each document [a, b) (the whole row
    [0, S) when `segments` is None) cut into consecutive chunks of `chunk_size` tokens counted from
    its own start, the last one shorter. Attention within segments is then attention within
    chunks within documents: a document packed at any offset sees the chunks it would see alone."""
    out = []
    for a, b in segments if segments is not None else ((0, seq_len),):
        out += [(s, min(s + chunk_size, b)) for s in range(a, b, chunk_size)]
    return tuple(out)


def row_cu_seqlens(cu: tuple[int, ...], batch: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Each batch row's document boundaries (0, ..., S) from `cu_seqlens` values (see the module
    docstring for the two forms). Checks the values."""
    if batch > 1 and len(cu) >= 2 and cu[0] == 0 and cu[-1] == batch * seq_len:
        segments_from_cu_seqlens(cu, batch * seq_len)  # checks the flattened boundaries never decrease
        rows = []
        for b in range(batch):
            lo, hi = b * seq_len, (b + 1) * seq_len
            inside = [c - lo for c in cu if lo <= c <= hi]
            if inside[0] != 0:
                raise ValueError(
                    f"cu_seqlens ends at B*S = {batch}x{seq_len}, so it gives each batch row its own documents over "
                    f"the flattened batch; then every row start b*S must be a boundary, and {lo} (row {b}) is not: "
                    "a document crosses rows. Split it at the row start"
                )
            rows.append(tuple(inside))
        return tuple(rows)
    segments_from_cu_seqlens(cu, seq_len, batch)  # checks; raises with the fix
    return (cu,) * batch
