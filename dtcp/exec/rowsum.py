"""Summing packed gradient rows into place: the all-gather's dK/dV, from its varlen launch's packed
keys (a key that two sequences share appears twice) to the float32 rank-major buffer its
reduce-scatter sends.

The torch form is a zero fill of the whole buffer, a cast of each gradient to float32 and an
indexed accumulate (`index_put_(accumulate=True)`: a sort of the indices, then a sum, each call).
With 128K tokens and 8 K/V heads of 128 the buffer alone is 1 GiB of float32 a backward. On CUDA
one Triton kernel does it all instead: each destination row is written once, with the sum of its
source rows read in their bf16 (fp16, fp32) and added in float32 in a fixed order (the sources'
packed order), or zeros where it has none. The sum of one or two rows is bit for bit the torch
form's (0 + a, then + b); with three or more sources the two forms may add in another order and
round differently (both are deterministic). `dtcp.config.merge = "torch"` forces the torch form (as it does the merges').

The index (`RowSources`) depends only on the plan: it is built once per plan on a CUDA device, with
the plan's packing (exec/allgather.py); elsewhere the torch form needs none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import config

try:  # Triton is optional: CPU-only installs don't have it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class RowSources:
    """For each of `slots` destination slots, its source rows in CSR form: the packed rows
    order[starts[u]:starts[u + 1]] (ascending) all land on slot u. Slot u is (rank, row) =
    divmod(u, rows_per_rank) of the rank-major buffer; its dK row is rank * 2 * rows_per_rank + row
    and its dV row rows_per_rank after it (the (N, 2, B*L, ...) layout the reduce-scatter sends)."""

    order: torch.Tensor  # (T_k,) int64: packed row indices, grouped by slot
    starts: torch.Tensor  # (slots + 1,) int64
    slots: int
    rows_per_rank: int


def row_sources(slot_of_row: torch.Tensor, slots: int, rows_per_rank: int, device) -> RowSources:
    """RowSources from each packed row's destination slot (T_k,) int64, built on `device`: on a
    GPU the sort and the counts cost the host nothing and need no synchronisation (on a 2-core
    CPU they took 3-5 ms for 64-128K keys, on every new document structure)."""
    slot_of_row = slot_of_row.to(device)
    order = torch.sort(slot_of_row, stable=True).indices
    counts = torch.zeros(slots, dtype=torch.int64, device=device).scatter_add_(0, slot_of_row,
                                                                               torch.ones_like(slot_of_row))
    starts = torch.zeros(slots + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=starts[1:])
    return RowSources(order, starts, slots, rows_per_rank)


def sum_rows_into(dkv: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, sources: Optional[RowSources],
                  dk_row: torch.Tensor, dv_row: torch.Tensor) -> None:
    """Write every row of `dkv` (N * 2 * B*L, Hkv, D) float32/float64, contiguous: the sum of the
    packed rows of dk (T_k, Hkv, D) (for dK rows) and dv (for dV rows) that land on it, zeros where
    none does. dk_row / dv_row: (T_k,) each packed row's dK / dV row (the torch form's index;
    `sources` is the same mapping by destination, or None where only the torch form runs)."""
    if sources is not None and _use_triton(dkv, dk, dv):
        _sum_rows_triton(dkv, dk, dv, sources)
        return
    dkv.zero_()
    dkv.index_put_((dk_row,), dk.to(dkv.dtype), accumulate=True)  # (deterministic: the sorted CUDA path)
    dkv.index_put_((dv_row,), dv.to(dkv.dtype), accumulate=True)


def _use_triton(dkv, dk, dv) -> bool:
    return (triton is not None and dkv.is_cuda and config.merge != "torch" and dkv.dtype == torch.float32
            and dk.dtype == dv.dtype and dk.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and dk.shape == dv.shape and dk.shape[1:] == dkv.shape[1:]
            and dkv.is_contiguous())


def _sum_rows_triton(dkv, dk, dv, sources: RowSources) -> None:
    dk, dv = dk.contiguous(), dv.contiguous()
    width = dkv[0].numel()  # Hkv * D
    block = min(1024, triton.next_power_of_2(width))
    grid = (sources.slots, triton.cdiv(width, block))
    _sum_rows_kernel[grid](dkv, dk, dv, sources.order, sources.starts, sources.rows_per_rank, width, BLOCK=block)


if triton is not None:

    @triton.jit
    def _sum_rows_kernel(dkv_ptr, dk_ptr, dv_ptr, order_ptr, starts_ptr, rows_per_rank, width,
                         BLOCK: tl.constexpr):
        """One destination slot (program 0) and BLOCK of its row's elements (program 1): the sum of
        its sources' dK and dV rows, in their packed order, stored once into both of its rows."""
        slot = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        first = tl.load(starts_ptr + slot)
        last = tl.load(starts_ptr + slot + 1)
        acc_k = tl.zeros([BLOCK], dtype=tl.float32)
        acc_v = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(first, last):
            src = tl.load(order_ptr + j).to(tl.int64) * width
            acc_k += tl.load(dk_ptr + src + cols, mask=inside, other=0.0).to(tl.float32)
            acc_v += tl.load(dv_ptr + src + cols, mask=inside, other=0.0).to(tl.float32)
        rank = slot // rows_per_rank
        row_k = (slot + rank * rows_per_rank).to(tl.int64)  # rank * 2 * rows_per_rank + (slot - rank * rows_per_rank)
        tl.store(dkv_ptr + row_k * width + cols, acc_k, mask=inside)
        tl.store(dkv_ptr + (row_k + rows_per_rank) * width + cols, acc_v, mask=inside)
