"""exec/rowsum.py: the index the all-gather's dK/dV sum is read by (RowSources), and the sum itself.

On CUDA a Triton kernel reads `RowSources` (tests/gpu/test_one_gpu_ranks.py compares it with the
torch form bit for bit); here the index is checked by running the kernel's algorithm over it in
Python (each slot: its sources' rows summed in their packed order, from zero, into its dK and dV
rows) against the torch form, which the all-gather used before and still uses off CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from dtcp.exec.rowsum import row_sources, sum_rows_into


def random_packing(seed: int, ranks: int, rows_per_rank: int, packed: int):
    """Each packed row's destination slot, with slots of 0, 1, 2 and 3 sources (a key that
    several sequences share, as a Balanced rank's cut chunks of one document do)."""
    rng = random.Random(seed)
    slots = ranks * rows_per_rank
    slot_of_row = [rng.randrange(slots) for _ in range(packed)]
    for extra in range(3):  # make sure of a slot with 3 sources, and slots with none
        slot_of_row.append(slot_of_row[0])
    return torch.tensor(slot_of_row, dtype=torch.int64), slots


def kernels_algorithm(dkv, dk, dv, sources):
    """What exec/rowsum.py's Triton kernel does, in Python over the same index."""
    width_rows = sources.rows_per_rank
    for slot in range(sources.slots):
        idx = sources.order[sources.starts[slot]:sources.starts[slot + 1]].tolist()
        acc_k = torch.zeros(dk.shape[1:], dtype=dkv.dtype)
        acc_v = torch.zeros(dv.shape[1:], dtype=dkv.dtype)
        for i in idx:
            acc_k += dk[i].to(dkv.dtype)
            acc_v += dv[i].to(dkv.dtype)
        rank, row = divmod(slot, width_rows)
        dkv[rank * 2 * width_rows + row] = acc_k
        dkv[rank * 2 * width_rows + width_rows + row] = acc_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed,ranks,rows_per_rank,packed", [(0, 2, 16, 20), (1, 4, 32, 100), (2, 8, 8, 90)])
def test_row_sources_sum_equals_the_indexed_accumulate(dtype, seed, ranks, rows_per_rank, packed):
    slot_of_row, slots = random_packing(seed, ranks, rows_per_rank, packed)
    rank, row = slot_of_row // rows_per_rank, slot_of_row % rows_per_rank
    dk_row = rank * 2 * rows_per_rank + row
    dv_row = dk_row + rows_per_rank
    g = torch.Generator().manual_seed(seed)
    dk = torch.randn(len(slot_of_row), 3, 8, generator=g).to(dtype)
    dv = torch.randn(len(slot_of_row), 3, 8, generator=g).to(dtype)
    sources = row_sources(slot_of_row, slots, rows_per_rank, "cpu")
    counts = torch.bincount(slot_of_row, minlength=slots)
    assert counts.max() >= 3 and (counts == 0).any()  # (the cases the index must get right)
    assert sources.starts[-1] == len(slot_of_row) and sorted(sources.order.tolist()) == list(range(len(slot_of_row)))

    torch_form = torch.full((ranks * 2 * rows_per_rank, 3, 8), float("nan"))  # every row must be written
    sum_rows_into(torch_form, dk, dv, sources, dk_row, dv_row)
    by_sources = torch.full_like(torch_form, float("nan"))
    kernels_algorithm(by_sources, dk, dv, sources)
    assert not torch_form.isnan().any() and not by_sources.isnan().any()
    # Up to two sources a slot: the same additions from zero, bit for bit; three in another order
    # of the same terms may round differently, by float32 rounding only.
    two = (counts <= 2).nonzero().flatten()
    k_rows = (two // rows_per_rank) * 2 * rows_per_rank + two % rows_per_rank
    for rows_ in (k_rows, k_rows + rows_per_rank):
        assert torch.equal(by_sources[rows_], torch_form[rows_])
    torch.testing.assert_close(by_sources, torch_form, rtol=1e-6, atol=1e-6)
    exact = torch.zeros(ranks * 2 * rows_per_rank, 3, 8, dtype=torch.float64)
    exact.index_add_(0, dk_row, dk.double())
    exact.index_add_(0, dv_row, dv.double())
    torch.testing.assert_close(torch_form.double(), exact, rtol=1e-6, atol=1e-6)
