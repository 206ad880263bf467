"""Schedules for sliding windows and documents, checked against brute-force masks built
independently (tests/reference.window_doc_mask). Pure Python: no process group."""

from __future__ import annotations

import math

import pytest
import torch

import dtcp
from dtcp.plan import segments_from_cu_seqlens
from dtcp.plan import AttnMask, ring_plans
from reference import window_doc_mask

LAYOUTS = [dtcp.Contiguous(), dtcp.Zigzag(), dtcp.Striped(1), dtcp.Striped(2)]


def check_plans(layout, world_size, seq_len, is_causal, window, cu=None):
    """Every visible (query, key) pair is computed exactly once, nothing masked is computed,
    every task is trimmed, and all ranks walk the same chain of offsets."""
    local_len = seq_len // world_size
    segments = segments_from_cu_seqlens(tuple(cu), seq_len) if cu is not None else None
    mask = AttnMask.make(is_causal, window, segments)
    plans = ring_plans(layout, local_len, world_size, is_causal, mask)
    truth = window_doc_mask(seq_len, is_causal=is_causal, window=window, cu_seqlens=cu)
    offsets = None
    for rank, plan in enumerate(plans):
        q_pos = layout.global_positions(seq_len, world_size, rank)
        got = torch.zeros(seq_len, seq_len, dtype=torch.int64)  # indexed by global positions
        mine = [((rank - s.src) % world_size, s.shift) for s in plan.steps]
        assert offsets is None or mine == offsets, "ranks disagree on the chain"
        offsets = mine
        assert len({s.src for s in plan.steps}) == len(plan.steps), "a block is visited twice"
        for step in plan.steps:
            k_pos = layout.global_positions(seq_len, world_size, step.src)
            for t in step.tasks:
                assert t.q_len > 0 and t.k_len > 0
                vis = torch.tensor([[t.visible(i, j) for j in range(t.k_len)] for i in range(t.q_len)])
                assert vis.any(1).all() and vis.any(0).all(), ("untrimmed task", t)
                qi = q_pos[t.q_start:t.q_end][:, None].expand(-1, t.k_len)[vis]
                kj = k_pos[t.k_start:t.k_end][None, :].expand(t.q_len, -1)[vis]
                got.index_put_((qi, kj), torch.ones_like(qi), accumulate=True)
        want = truth[q_pos].long()
        assert torch.equal(got[q_pos], want), (rank, window, cu)
    return plans


WINDOWS = [(0, 0), (1, 0), (3, 0), (4, 0), (5, 0), (9, 0), (40, 0), (2, 3), (5, 1), (0, 7), (-1, 2), (3, -1)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_window_schedule_covers_exactly_the_visible_pairs(layout, world_size):
    seq_len = layout.multiple(world_size) * (4 if isinstance(layout, dtcp.Contiguous) else 2)
    for window in WINDOWS:
        for is_causal in (True, False):
            if is_causal and window[1] > 0:
                continue
            check_plans(layout, world_size, seq_len, is_causal, window)


DOCS_16 = [
    [0, 2, 5, 7, 16],  # short documents
    [0, 11, 16],  # a document over three ranks
    [0, 4, 8, 12, 16],  # aligned with rank boundaries
    [0, 3, 13, 16],  # ranks 1 and 2 start no document
    [0, 1, 2, 3, 9, 10, 16],  # single-token documents
    [0, 16],
    [0, 5, 5, 16, 16],  # empty documents (repeated boundaries) are allowed
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("cu", DOCS_16, ids=str)
def test_document_schedule_covers_exactly_the_visible_pairs(layout, cu):
    for window in [(-1, -1), (2, 0), (5, 0), (1, 2)]:
        for is_causal in (True, False):
            if is_causal and window[1] > 0:
                continue
            check_plans(layout, 4, 16, is_causal, window, cu)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("local_len", [4, 5])
def test_contiguous_window_rounds_are_ceil_w_over_m(world_size, local_len):
    """C = min(ceil(left / M), N - 1) forward rounds plus ceil(right / M) backward ones (when
    the two do not wrap round the ring), and each block pattern is one kernel call."""
    seq_len = world_size * local_len
    for left in range(0, seq_len + 3):
        for right in (0, 1, local_len, local_len + 2):
            plans = check_plans(dtcp.Contiguous(), world_size, seq_len, False, (left, right)) if left % 3 == 0 else \
                ring_plans(dtcp.Contiguous(), local_len, world_size, False, AttnMask.make(False, (left, right)))
            c_left = min(math.ceil(left / local_len), world_size - 1)
            c_right = min(math.ceil(right / local_len), world_size - 1)
            want = c_left + c_right if c_left + c_right < world_size else world_size - 1
            for plan in plans:
                assert plan.num_rounds == want, (left, right, [s.src for s in plan.steps])
                assert all(len(s.tasks) <= 1 for s in plan.steps)


def test_four_block_patterns_of_a_contiguous_window():
    """M = 4 tokens per rank, causal window 6: rank 2 sees its own block through the diagonal
    band, rank 1's block fully except the lower-left corner (window edge), and rank 0's only in
    the upper-right corner."""
    plan = ring_plans(dtcp.Contiguous(), 4, 4, True, AttnMask.make(True, (6, 0)))[2]
    (own,), (prev,), (prevprev,) = (s.tasks for s in plan.steps)
    assert (own.lo, own.hi) == (None, 0)  # W >= M - 1: the diagonal block is plain causal
    assert (prev.q_start, prev.q_end, prev.k_start, prev.k_end, prev.lo, prev.hi) == (0, 4, 0, 4, -2, None)
    assert (prevprev.q_start, prevprev.q_end, prevprev.k_start, prevprev.k_end) == (0, 2, 2, 4)
    assert (prevprev.lo, prevprev.hi) == (0, None)  # key at or after the query: upper-right
    # window smaller than M: the diagonal block is a band, the previous block a triangle
    plan = ring_plans(dtcp.Contiguous(), 4, 4, True, AttnMask.make(True, (2, 0)))[2]
    (own,), (prev,) = (s.tasks for s in plan.steps)
    assert (own.lo, own.hi) == (-2, 0)
    assert (prev.q_start, prev.q_end, prev.k_start, prev.k_end, prev.lo, prev.hi) == (0, 2, 2, 4, 0, None)
    # a full block
    plan = ring_plans(dtcp.Contiguous(), 4, 4, True, AttnMask.make(True, (9, 0)))[3]
    assert plan.steps[1].tasks[0].is_full and plan.num_rounds == 3


def test_aligned_documents_need_no_communication():
    mask = AttnMask.make(True, (-1, -1), segments_from_cu_seqlens((0, 4, 8, 12, 16), 16))
    for plan in ring_plans(dtcp.Contiguous(), 4, 4, True, mask):
        assert plan.num_rounds == 0 and len(plan.steps[0].tasks) == 1


def test_contiguous_documents_touch_off_diagonal_blocks_once():
    """On a contiguous layout an off-diagonal block is touched only by the document that runs
    into the rank: one rectangle (trapezoid under a window) per step."""
    cu = (0, 3, 9, 10, 13, 30, 32)
    mask = AttnMask.make(True, (5, 0), segments_from_cu_seqlens(cu, 32))
    for plan in ring_plans(dtcp.Contiguous(), 8, 4, True, mask):
        for step in plan.steps[1:]:
            assert len(step.tasks) <= 1


def test_bad_cu_seqlens_messages():
    with pytest.raises(ValueError, match="starts at 1"):
        segments_from_cu_seqlens((1, 16), 16)
    with pytest.raises(ValueError, match="ends at 12 but the sequence has S = 16"):
        segments_from_cu_seqlens((0, 12), 16)
    with pytest.raises(ValueError, match="decreases at index 2"):
        segments_from_cu_seqlens((0, 9, 4, 16), 16)
    with pytest.raises(ValueError, match="One document"):
        segments_from_cu_seqlens((0,), 16)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("doc_lens", [(5, 3), (1, 1, 13), (8,), (0, 7, 0, 2, 9)], ids=str)
def test_doc_zigzag_schedule_covers_exactly_the_visible_pairs(world_size, doc_lens):
    layout = dtcp.DocZigzag(doc_lens)
    seq_len = layout.padded_len(world_size)
    segments = layout.segments(world_size)
    truth = window_doc_mask(seq_len, is_causal=True, segments=segments)
    for window in [(-1, -1), (2, 0)]:
        truth = window_doc_mask(seq_len, is_causal=True, window=window, segments=segments)
        mask = AttnMask.make(True, window, segments)
        for rank, plan in enumerate(ring_plans(layout, seq_len // world_size, world_size, True, mask)):
            q_pos = layout.global_positions(seq_len, world_size, rank)
            got = torch.zeros(seq_len, seq_len, dtype=torch.int64)
            for step in plan.steps:
                k_pos = layout.global_positions(seq_len, world_size, step.src)
                for t in step.tasks:
                    for i in range(t.q_len):
                        for j in range(t.k_len):
                            if t.visible(i, j):
                                got[q_pos[t.q_start + i], k_pos[t.k_start + j]] += 1
            assert torch.equal(got[q_pos], truth[q_pos].long()), (rank, window)


def test_doc_zigzag_balances_causal_work():
    layout = dtcp.DocZigzag((16, 8, 24))
    n = 4
    seq_len = layout.padded_len(n)
    plans = ring_plans(layout, seq_len // n, n, True, AttnMask.make(True, (-1, -1), layout.segments(n)))
    work = [sum(t.q_len * t.k_len for s in p.steps for t in s.tasks) for p in plans]
    assert len(set(work)) == 1, work  # same number of scores on every rank (up to the diagonal masks)


def test_flash_windows_express_every_trimmed_band():
    """CUDA flash is bottom-right aligned: a band task fits it iff its window is non-negative.
    Trimming guarantees that (the last row sees a key, the last key is seen), so backend="auto"
    can always use flash for windows and documents."""
    from dtcp.plan import Band

    def _flash_window(q_len, k_len, lo, hi):
        return Band(lo, hi).aligned_window(q_len, k_len)

    n = 0
    for layout in LAYOUTS:
        for cu in (None, [0, 3, 13, 16], [0, 1, 2, 3, 9, 10, 16]):
            for window in WINDOWS:
                segments = segments_from_cu_seqlens(tuple(cu), 16) if cu else None
                for plan in ring_plans(layout, 4, 4, False, AttnMask.make(False, window, segments)):
                    for t in (t for s in plan.steps for t in s.tasks):
                        left, right = _flash_window(t.q_len, t.k_len, t.lo, t.hi)
                        assert (t.lo is None or left >= 0) and (t.hi is None or right >= 0), t
                        n += 1
    assert n > 1000
