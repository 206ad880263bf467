"""bf16 exactness of the ring on ONE GPU: N ranks simulated in one process (tests/sim_ranks.py,
dtcp.comm.simulated), each with its real plan, kernel calls (fused step launches included) and the
blocks it really receives, against float64. For every rank and every quantity (out, lse, dq and,
on the rank's own keys, dk, dv) the ring's error stays within 1.5x the same kernel's own error
over the whole sequence in one call, measured on the same rows. The all-gather schedule as one
varlen call per rank (tests/sim_ranks.py simulated_allgather: one thread a rank, the keys other
ranks read exchanged for real and their float32 dK/dV sent back, as the route runs it) is held to the same bound on the document cases, and Ulysses
(simulated_ulysses: each rank's route, its all-to-alls carrying the real bytes) on every case.

    python -m pytest -q -s tests/gpu/test_one_gpu_ranks.py
"""

from __future__ import annotations

import random

import pytest
import torch

import dtcp
from dtcp.kernels import KERNELS, VarlenSeqs
from reference import reference_attention, window_doc_mask
from sim_ranks import simulated_allgather, simulated_allgather_tasks, simulated_ring, simulated_ulysses

pytestmark = pytest.mark.one_gpu

S, HQ, HKV, D = 4096, 4, 2, 128


def long_tailed(total, seed, floor=64):
    rng = random.Random(seed)
    docs = []
    while sum(docs) < total:
        docs.append(int(floor / rng.random() ** (1 / 1.1)))
    docs[-1] -= sum(docs) - total
    return tuple(d for d in docs if d > 0)


def in_sixteens(docs, total=S):
    """docs with lengths rounded to multiples of 16, summing to `total` (DocZigzag without
    padding for N up to 8: each document cut into 2N equal chunks)."""
    out = [max(16, round(d / 16) * 16) for d in docs]
    while sum(out) > total:
        out[out.index(max(out))] -= 16
    out[-1] += total - sum(out)
    return tuple(out)


def _cu(docs):
    out = [0]
    for n in docs:
        out.append(out[-1] + n)
    return out


def kernel_whole(kernel, q, k, v, dout, docs, window, scale):
    """The kernel's own answer: the whole sequence in one varlen call (rows form)."""
    cu = _cu(docs) if docs else [0, q.shape[2]]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    t = torch.tensor([cu, cu], dtype=torch.int32, device=q.device)
    seqs = VarlenSeqs(tuple(cu), tuple(cu), t[0], t[1], max(lens), max(lens))
    rows = [x[0].transpose(0, 1).contiguous() for x in (q, k, v, dout)]
    out, lse = kernel.varlen_forward(rows[0], rows[1], rows[2], seqs, window, scale)
    dq, dk, dv = kernel.varlen_backward(rows[3], rows[0], rows[1], rows[2], out, lse, seqs, window, scale)
    block = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    return block(out), lse[None], block(dq), block(dk), block(dv)


def _err_on(a, b, idx):
    a, b = a.double().index_select(2, idx), b.double().index_select(2, idx)
    return ((a - b).norm() / b.norm()).item()


CASES = [  # (name, layout for n ranks, documents, window)
    ("causal zigzag", lambda n, docs: dtcp.Zigzag(), None, (-1, 0)),
    ("documents zigzag", lambda n, docs: dtcp.Zigzag(), long_tailed(S, 1), (-1, 0)),
    ("documents balanced", lambda n, docs: dtcp.Balanced(docs, min_chunk=64), long_tailed(S, 1), (-1, 0)),
    ("documents balanced 2", lambda n, docs: dtcp.Balanced(docs, min_chunk=64), long_tailed(S, 4), (-1, 0)),
    ("equal documents balanced", lambda n, docs: dtcp.Balanced(docs, min_chunk=64), (512,) * 8, (-1, 0)),
    # ~50 documents a step's launch, rows and keys apart in order: FA4 reads them in place and the
    # merges and dK/dV adds run once over the window with a row mask (the rows between unwritten)
    ("documents doczigzag", lambda n, docs: dtcp.DocZigzag(docs), in_sixteens(long_tailed(S, 1)), (-1, 0)),
    ("window contiguous", lambda n, docs: dtcp.Contiguous(), None, (300, 0)),
    ("window documents contiguous", lambda n, docs: dtcp.Contiguous(), long_tailed(S, 2), (300, 0)),
]


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name,make_layout,docs,window", CASES, ids=[c[0] for c in CASES])
def test_ring_bf16_within_the_kernels_own_error(backend, n, name, make_layout, docs, window):
    within_the_kernels_own_error(simulated_ring, backend, n, name, make_layout, docs, window)


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "launch_by_launch"])
@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("name,make_layout,docs,window", CASES, ids=[c[0] for c in CASES])
def test_ring_bf16_slots_and_launch_by_launch(backend, name, make_layout, docs, window, slots, monkeypatch):
    """At N = 4, the later launches' outputs and dQ kept whole and merged (summed) once a pass
    (exec/fused.py Slots, the default), and merged and added launch by launch: both within the
    kernel's own error. Counts the passes that kept their launches: some on the cases whose later
    launches' rows are one range each, none with the setting at 0."""
    import dtcp.exec.ring as ring_mod
    kept = []
    merge_slots = ring_mod.merge_slots_
    monkeypatch.setattr(ring_mod, "merge_slots_", lambda *a, **k: kept.append(1) or merge_slots(*a, **k))
    with dtcp.config.override(merge_slots_bytes=dtcp.config.merge_slots_bytes if slots else 0):
        within_the_kernels_own_error(simulated_ring, backend, 4, name, make_layout, docs, window)
    if not slots:
        assert not kept
    elif name in ("causal zigzag", "window contiguous", "documents zigzag"):
        assert kept, name


GROUP_CASES = [c for c in CASES if c[0] in ("causal zigzag", "documents zigzag", "documents balanced",
                                             "documents balanced 2")]  # (each has two rounds or more)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "packed"])
@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("n,size", [(4, 3), (8, 7), (8, 3)])
@pytest.mark.parametrize("name,make_layout,docs,window", GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_grouped_ring_bf16_within_the_kernels_own_error(backend, n, size, name, make_layout, docs, window,
                                                        in_place, monkeypatch):
    """The ring in groups of `size` (exec/grouped.py), each group's blocks received straight into
    one buffer: read in place by at most two launches (their dK/dV written into a buffer of the same
    shape, whose slices go home in float32), or packed into one launch. Within the kernel's own
    error; counts the groups that ran in place (some on causal zigzag, where every group is in
    place; none when packing is asked for)."""
    import dtcp.exec.grouped as grouped_mod
    kinds = []  # the groups the executor ran, by kind
    indices = grouped_mod._group_indices

    def counted(*a, **k):
        got = indices(*a, **k)
        kinds.extend(type(g).__name__ for g, _ in got or ())
        return got

    monkeypatch.setattr(grouped_mod, "_group_indices", counted)
    with dtcp.config.override(ring_steps_per_launch=size, ring_groups_in_place=in_place):
        within_the_kernels_own_error(simulated_ring, backend, n, name, make_layout, docs, window)
    assert kinds, "no ring call ran in groups"
    if not in_place:
        assert "InPlaceGroup" not in kinds, kinds
    elif name == "causal zigzag":
        assert set(kinds) == {"InPlaceGroup"}, kinds


DOC_CASES = [c for c in CASES if c[2] is not None]


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name,make_layout,docs,window", DOC_CASES, ids=[c[0] for c in DOC_CASES])
def test_allgather_bf16_within_the_kernels_own_error(backend, n, name, make_layout, docs, window):
    """The all-gather as one varlen launch per rank (documents; Balanced's many runs included),
    moving only the keys other ranks read (plan.KeyExchange), as the route runs it."""
    within_the_kernels_own_error(simulated_allgather, backend, n, name, make_layout, docs, window)


TASK_CASES = [c for c in CASES if c[2] is None]  # (no documents: the all-gather runs task by task)


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name,make_layout,docs,window", TASK_CASES, ids=[c[0] for c in TASK_CASES])
def test_allgather_by_task_bf16_within_the_kernels_own_error(backend, n, name, make_layout, docs, window):
    """The all-gather task by task (causal zigzag: two calls a rank; a window on contiguous): K/V
    put in token order piece by piece, dK/dV summed with each key's first share copied in, sent
    back in rank-major order piece by piece."""
    within_the_kernels_own_error(simulated_allgather_tasks, backend, n, name, make_layout, docs, window)


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name,make_layout,docs,window", CASES, ids=[c[0] for c in CASES])
def test_ulysses_bf16_within_the_kernels_own_error(backend, n, name, make_layout, docs, window):
    """Ulysses: each rank's head exchange (the all-to-alls carrying every rank's bytes), its heads
    over the whole sequence in one call, and the exchange back; the op's backward (exchanging the
    forward's tensors again). 8 query heads, 2 K/V heads: at N = 4 and 8 the K/V heads are
    replicated and their gradients summed in float32."""
    within_the_kernels_own_error(simulated_ulysses, backend, n, name, make_layout, docs, window, heads=(8, 2),
                                 ring_schedule=False)


def within_the_kernels_own_error(schedule, backend, n, name, make_layout, docs, window, heads=(HQ, HKV),
                                 ring_schedule=True):
    kernel = KERNELS[backend]
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv = heads
    full = [torch.randn(1, h, S, D, device="cuda", generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = (x.to(torch.bfloat16) for x in full)
    why = kernel.feature_reason(q, v, None, False) or kernel.reject_reason(q, k, [])
    if why is not None:
        pytest.skip(f"{backend}: {why}")
    scale = D ** -0.5
    layout = make_layout(n, docs)
    if ring_schedule:  # (Ulysses' route checks its own local call: the schedule raises NotImplementedError)
        from dtcp.plan import AttnMask, ring_plans
        from sim_ranks import segments_of
        plans = ring_plans(layout, S // n, n, True,
                           AttnMask.make(True, window, None if docs is None else segments_of(docs)))
        why = kernel.reject_reason(q, k, [t for p in plans for t in p.tasks])
        if why is not None:  # a route would not pick this kernel here (auto takes another; backend= raises)
            pytest.skip(f"{backend} refuses this schedule: {why}")
    mask = window_doc_mask(S, is_causal=True, window=window, cu_seqlens=_cu(docs) if docs else None).cuda()
    ref = [x.double().clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, mask=mask, scale=scale)
    out_ref.backward(dout.double())
    want = (out_ref.detach(), lse_ref.detach(), *(x.grad for x in ref))
    try:
        ring = schedule(layout, n, q, k, v, dout, kernel, window=window, docs=docs, scale=scale)
    except NotImplementedError as e:  # the route takes another kernel for this varlen call
        pytest.skip(f"{backend} refuses this varlen call: {e}")
    own = kernel_whole(kernel, q, k, v, dout, docs, window, scale)
    worst = 0.0
    for r in range(n):
        idx = layout.global_positions(S, n, r).cuda()
        for key, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), ring, own, want):
            ring_err, own_err = _err_on(a, c, idx), _err_on(b, c, idx)
            ratio = ring_err / own_err
            worst = max(worst, ratio)
            assert ring_err <= 1.5 * own_err, (name, n, backend, r, key, ring_err, own_err)
    print(f"\n{schedule.__name__} {backend} n={n} {name}: worst schedule/kernel error ratio {worst:.3f}")


def _slots_case(seed=7, batch=2, h=4, length=1024, d=128):
    """A pass's first-launch results and five kept launches (over rows 100-999, 500-999, 100-299
    and 600-639, and one whose rows lie apart in the window 200-399: 200-249 and 330-399; rows
    0-99 and 1000-1023 reach none; rows without keys in the first launch and in some kept ones),
    as exec/merge.py merge_slots_ / sum_slots_ take them: spans (a, e, o, base, T)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    spans = ((100, 1000, 0, 0, 900), (500, 1000, 900, 900, 500), (100, 300, 1400, 1400, 200),
             (600, 640, 1600, 1600, 40), (200, 250, 1640, 1640, 200), (330, 400, 1770, 1640, 200))
    rows = 1840
    out = torch.randn(batch, h, length, d, device="cuda", generator=g).to(torch.bfloat16)
    lse = 3 * torch.randn(batch, h, length, device="cuda", generator=g)
    out[:, :, 100:120], lse[:, :, 100:120] = 0.0, float("-inf")
    slot_out = torch.randn(batch, rows, h, d, device="cuda", generator=g).to(torch.bfloat16)
    slot_lse = 3 * torch.randn(batch * h * rows, device="cuda", generator=g)  # (B, H, T) per launch (fused.slot_lse)
    slot_lse[batch * h * 900:].view(-1)[:37] = float("-inf")  # rows 500-536 of the second kept launch, b 0, head 0
    slot_out[:, 1690:1770] = float("nan")  # the window's rows between its ranges: never written, never read
    table = torch.tensor(spans, dtype=torch.int32, device="cuda")
    return out, lse, slot_out, slot_lse, spans, table


def test_triton_slots_merge_as_exact_as_launch_by_launch():
    """exec/merge.py merge_slots_: the kept launches merged into the first launch's results in one
    Triton pass, against float64: as close as merging them launch by launch into a float32
    accumulator (the Triton merge, cast back once), for out and lse; rows without keys in every
    part stay (0, -inf); no NaN."""
    from dtcp.exec import merge as M
    out, lse, slot_out, slot_lse, spans, table = _slots_case()
    assert M._slots_on_triton(out, lse, slot_out)
    got_out, got_lse = out.clone(), lse.clone()
    unread = slot_out.clone()
    unread[0, 900:937, 0] = float("nan")  # (a part without keys is not read: whatever its rows hold)
    M.merge_slots_(got_out, got_lse, unread, slot_lse, spans, table)
    want_out, want_lse = out.double(), lse.double()
    M.merge_slots_(want_out, want_lse, slot_out.double(), slot_lse.double(), spans, None)  # (torch, float64)
    seq_out, seq_lse = out.float(), lse.clone()  # launch by launch, float32, cast back once
    bsz, h = out.shape[:2]
    for a, e, o, base, t in spans:
        c = o - base
        M.merge_into_(seq_out[:, :, a:e], seq_lse[:, :, a:e], slot_out[:, o:o + e - a].transpose(1, 2),
                      slot_lse[bsz * h * base:bsz * h * (base + t)].view(bsz, h, t)[:, :, c:c + e - a])
    seq_out = seq_out.to(torch.bfloat16)
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    assert err(got_out, want_out) <= 1.01 * err(seq_out, want_out), (err(got_out, want_out), err(seq_out, want_out))
    finite = want_lse.isfinite()
    assert torch.equal(got_lse.isfinite(), finite)
    assert err(got_lse[finite], want_lse[finite]) <= 1e-5
    assert (got_out[:, :, 100:120].float() != 0).any()  # (rows without keys in the first launch took the kept ones')
    for x, y in ((got_out, out), (got_lse, lse)):  # rows no kept launch reaches: not written
        assert torch.equal(x[:, :, :100], y[:, :, :100]) and torch.equal(x[:, :, 1000:], y[:, :, 1000:])


def test_triton_slots_sum_equals_the_float32_adds():
    """exec/merge.py sum_slots_: the first launch's dQ plus every kept launch's, in one Triton pass:
    the bits of float32 adds in launch order (the torch form), rounded once."""
    from dtcp.exec import merge as M
    out, _, slot_out, _, spans, table = _slots_case(seed=8)
    assert M._slots_on_triton(out, slot_out)
    got = out.clone()
    M.sum_slots_(got, slot_out, spans, table, torch.float32)
    want = out.clone()
    M.sum_slots_(want, slot_out, spans, None, torch.float32)
    assert torch.equal(got, want) and not torch.equal(got, out)
    assert torch.equal(got[:, :, :100], out[:, :, :100]) and torch.equal(got[:, :, 1000:], out[:, :, 1000:])


def test_triton_merge_with_a_row_mask():
    """The fused Triton merge with a row mask (gapped launches over many ranges): rows left out
    keep the accumulators bit for bit, whatever the block holds there (NaN here); the others
    equal the torch merge."""
    from dtcp.exec import merge as M
    g = torch.Generator(device="cuda").manual_seed(3)
    h, length, d = 4, 1000, 128
    out = torch.randn(1, h, length, d, device="cuda", generator=g)
    lse = torch.randn(1, h, length, device="cuda", generator=g)
    out[:, :, :50], lse[:, :, :50] = 0.0, float("-inf")  # rows that have seen no key yet
    blk = torch.randn(1, h, length, d, device="cuda", generator=g).to(torch.bfloat16)
    blk_lse = torch.randn(1, h, length, device="cuda", generator=g)
    used = torch.rand(length, device="cuda", generator=g) < 0.6
    blk[:, :, ~used] = float("nan")
    blk_lse[:, :, ~used] = float("nan")
    assert M._use_triton(out, lse, blk, blk_lse)
    got_out, got_lse = out.clone(), lse.clone()
    M.merge_into_(got_out, got_lse, blk, blk_lse, rows_used=used)
    want_out, want_lse = out.clone(), lse.clone()
    M._merge_torch(want_out, want_lse, blk, blk_lse, rows_used=used)
    assert torch.equal(got_out[:, :, ~used], out[:, :, ~used]) and torch.equal(got_lse[:, :, ~used], lse[:, :, ~used])
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("role", ["only", "first", "last"])
def test_triton_merge_between_the_result_and_the_accumulator(role, masked):
    """The ring's later launches merge run by run (exec/fused.py Landing): from the bf16 result
    into itself (a row one later launch reaches), from it into the float32 accumulator (the first
    of several) or from the accumulator into it (the last). Each gives the bits of the float32
    path (the result copied into float32, merged in place, cast back); rows a row mask leaves
    out are not written."""
    from dtcp.exec import merge as M
    from test_ring_one_launch import merged_between_result_and_accumulator
    written, before, want, lse, want_lse, keep, (src, dst) = merged_between_result_and_accumulator(
        "cuda", role, masked, 4, 1000, 128)
    assert M._use_triton(dst, lse, dst, lse, src)  # (the Triton merge ran)
    assert torch.equal(written[:, :, keep], want[:, :, keep]) and torch.equal(lse, want_lse)
    assert torch.equal(written[:, :, ~keep], before[:, :, ~keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_row_sum_equals_the_indexed_accumulate(dtype):
    """The all-gather's dK/dV sum (exec/rowsum.py): the Triton kernel writes every row of the
    float32 buffer, the sources of each summed in their packed order, and gives the torch form's
    bits (zero fill, float32 cast, index_put_ accumulate) where a slot has up to two sources; 128K
    packed rows of 8 x 128 into 4 ranks' rows, slots with 0-3 sources."""
    from dtcp.exec import rowsum as RS
    from test_rowsum import random_packing
    ranks, rows_per_rank = 4, 40_000
    slot_of_row, slots = random_packing(5, ranks, rows_per_rank, 128_000)
    rank, row = slot_of_row // rows_per_rank, slot_of_row % rows_per_rank
    dk_row = (rank * 2 * rows_per_rank + row).cuda()
    dv_row = dk_row + rows_per_rank
    g = torch.Generator(device="cuda").manual_seed(5)
    dk = torch.randn(len(slot_of_row), 8, 128, device="cuda", generator=g).to(dtype)
    dv = torch.randn(len(slot_of_row), 8, 128, device="cuda", generator=g).to(dtype)
    sources = RS.row_sources(slot_of_row, slots, rows_per_rank, "cuda")
    got = torch.full((ranks * 2 * rows_per_rank, 8, 128), float("nan"), device="cuda")
    assert RS._use_triton(got, dk, dv)
    RS.sum_rows_into(got, dk, dv, sources, dk_row, dv_row)
    want = torch.full_like(got, float("nan"))
    with dtcp.config.override(merge="torch"):
        RS.sum_rows_into(want, dk, dv, sources, dk_row, dv_row)
    assert not got.isnan().any()
    counts = torch.bincount(slot_of_row, minlength=slots)
    assert counts.max() >= 3 and (counts == 0).any()
    two = (counts <= 2).nonzero().flatten()
    k_rows = ((two // rows_per_rank) * 2 * rows_per_rank + two % rows_per_rank).cuda()
    for rows_ in (k_rows, k_rows + rows_per_rank):  # (dK rows, dV rows)
        assert torch.equal(got[rows_], want[rows_])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_one_launch_landing_equals_run_by_run():
    """exec/merge.py land_merge_ / land_add_: a later launch's merge and dQ add over its window in
    one launch, each row by its role (NONE between the launch's rows), bit for bit what exec/fused.py
    does run by run (merge_into_ with a source; the tensor ops of add_runs_) on rows-form views
    of (B, H, L, D) tensors, as the ring calls them; rows of no role keep their values."""
    from dtcp.exec import merge as M
    from dtcp.exec.fused import Where, _merge_runs_, add_runs_
    from dtcp.plan.fuse import FIRST, LAST, MID, ONLY
    g = torch.Generator(device="cuda").manual_seed(6)
    h, length, d, w0, w1 = 4, 900, 128, 100, 700
    roles_cpu = torch.randint(0, 5, (w1 - w0,), generator=torch.Generator().manual_seed(6), dtype=torch.int8)
    runs, start = [], None
    for i in range(w1 - w0 + 1):  # maximal runs of one role, rows of no role (4) left out
        r = int(roles_cpu[i]) if i < w1 - w0 else -1
        if start is not None and r != int(roles_cpu[start]):
            if int(roles_cpu[start]) != M.NONE_ROLE:
                runs.append((w0 + start, w0 + i, int(roles_cpu[start])))
            start = None
        if start is None and 0 <= r:
            start = i
    assert {role for _, _, role in runs} == {ONLY, FIRST, MID, LAST}
    roles = roles_cpu.cuda()
    where = Where((w0, w1), None, tuple((a, b) for a, b, _ in runs), gapped=True)

    def rows_of(x):  # (L, H, D) rows form of a (1, H, L, D) tensor
        return x[0].transpose(0, 1)
    result = torch.randn(1, h, length, d, device="cuda", generator=g).to(torch.bfloat16)
    acc = torch.randn(1, h, length, d, device="cuda", generator=g)
    lse = torch.randn(1, h, length, device="cuda", generator=g)
    lse[:, :, w0:w0 + 30] = float("-inf")
    blk = torch.randn(w1 - w0, h, d, device="cuda", generator=g).to(torch.bfloat16)  # the launch's (T, H, D)
    blk_lse = torch.randn(h, w1 - w0, device="cuda", generator=g)
    got = [t.clone() for t in (acc, result, lse)]
    want = [t.clone() for t in (acc, result, lse)]
    blk4, blk_lse4 = blk.transpose(0, 1).unsqueeze(0), blk_lse.unsqueeze(0)
    M.land_merge_(rows_of(got[0])[w0:w1].transpose(0, 1).unsqueeze(0), rows_of(got[1])[w0:w1].transpose(0, 1).unsqueeze(0),
                  got[2][0][:, w0:w1].unsqueeze(0), blk4, blk_lse4, roles)
    _merge_runs_(rows_of(want[0]), want[2][0], where, blk4, blk_lse4, rows_of(want[1]), runs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[1], result) and not torch.equal(got[0], acc)  # (both were written)
    grad = torch.randn(w1 - w0, h, d, device="cuda", generator=g).to(torch.bfloat16)
    grad[roles == M.NONE_ROLE] = float("nan")  # undefined between the launch's rows
    got = [t.clone() for t in (acc, result)]
    want = [t.clone() for t in (acc, result)]
    M.land_add_(rows_of(got[0])[w0:w1], rows_of(got[1])[w0:w1], grad, roles)
    add_runs_(rows_of(want[0]), rows_of(want[1]), where, grad, runs)  # (no landing: the tensor ops)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not got[1].isnan().any()


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("hkv", [2, 4])
def test_launch_into_strided_results_equals_a_fresh_launch(backend, hkv):
    """The ring's first launch writes into the call's results (out, lse, dq, dk, dv: rows views
    of (B, H, L, D) tensors, strided): what the kernel returns as fresh tensors, and nothing
    outside the views is written. The forward bit for bit; the backward to one bf16 rounding (its
    dQ (and GQA dK/dV) sum over key tiles with float32 atomics, in an order that varies from call
    to call: flash's two fresh calls differ so too), where a wrong layout would differ by O(1)."""
    kernel = KERNELS[backend]
    g = torch.Generator(device="cuda").manual_seed(4)
    batch, length = 2, 1536
    q, dout = (torch.randn(batch, HQ, length, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, hkv, length, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    why = kernel.feature_reason(q, v, None, False) or kernel.reject_reason(q, k, [])
    if why is not None:
        pytest.skip(f"{backend}: {why}")
    cu = [0, 300, 301, 1100, length]
    t = torch.tensor([cu, cu], dtype=torch.int32, device="cuda")
    seqs = VarlenSeqs(tuple(cu), tuple(cu), t[0], t[1], 799, 799)
    window, scale = (-1, 0), D ** -0.5
    rows = lambda x, b: x[b].transpose(0, 1)  # noqa: E731  (L, H, D), strided
    for b in range(batch):
        out, lse = kernel.varlen_forward(rows(q, b), rows(k, b), rows(v, b), seqs, window, scale)
        grads = kernel.varlen_backward(rows(dout, b), rows(q, b), rows(k, b), rows(v, b), out, lse, seqs, window, scale)
        into = [torch.full((batch,) + x.shape[1:], 7.0, device="cuda", dtype=x.dtype) for x in (q, q, k, v)]
        lse_into = torch.full((batch, HQ, length), 7.0, device="cuda")
        kernel.varlen_forward_into(rows(q, b), rows(k, b), rows(v, b), seqs, window, scale, rows(into[0], b), lse_into[b])
        kernel.varlen_backward_into(rows(dout, b), rows(q, b), rows(k, b), rows(v, b), out, lse, seqs, window, scale,
                                    dq=rows(into[1], b), dk=rows(into[2], b), dv=rows(into[3], b))
        assert torch.equal(rows(into[0], b), out) and torch.equal(lse_into[b], lse)
        for got, want in zip([rows(x, b) for x in into[1:]], grads):  # within one bf16 rounding of the value
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
        for x in into + [lse_into]:  # the other batch row untouched
            assert (x[1 - b] == 7.0).all()


@pytest.mark.parametrize("backend", ["fa4", "flash"])
@pytest.mark.parametrize("band", [(None, 0), (None, None), (-700, 0)], ids=["causal", "full", "window"])
def test_block_into_slots_equals_a_fresh_call(backend, band):
    """A later ring task writes its out, lse (forward) and dQ (backward) into its slot (exec/fused.py
    Slots: a (B, T, H, D) piece of a (B, R, H, D) tensor, seen as (B, H, T, D), strided over the
    batch): what the kernel returns as fresh tensors, the forward bit for bit, dQ to one bf16
    rounding (as above); the rest of the slots untouched."""
    kernel = KERNELS[backend]
    g = torch.Generator(device="cuda").manual_seed(9)
    batch, lq, lk, rows_all, off = 2, 1024, 2048, 3000, 700
    q, dout = (torch.randn(batch, HQ, lq, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, HKV, lk, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    why = kernel.feature_reason(q, v, None, False) or kernel.reject_reason(q, k, [])
    if why is not None:
        pytest.skip(f"{backend}: {why}")
    # (bottom-right: the block's last row sees the last key)
    lo, hi = (None if x is None else x + lk - lq for x in band)
    scale = D ** -0.5
    out, lse = kernel.forward(q, k, v, lo, hi, scale)
    dq, _, _ = kernel.backward(dout, q, k, v, out, lse, lo, hi, scale)
    slots = torch.full((batch, rows_all, HQ, D), 7.0, device="cuda", dtype=torch.bfloat16)
    slots_lse = torch.full((batch * HQ * rows_all,), 7.0, device="cuda")
    dq_slots = torch.full_like(slots, 7.0)
    piece = lambda x: x[:, off:off + lq].transpose(1, 2)  # noqa: E731
    lse_piece = slots_lse[batch * HQ * off:batch * HQ * (off + lq)].view(batch, HQ, lq)
    kernel.forward_into(q, k, v, lo, hi, scale, piece(slots), lse_piece)
    kernel.backward_into(dout, q, k, v, out, lse, lo, hi, scale, piece(dq_slots))
    assert torch.equal(piece(slots), out) and torch.equal(lse_piece, lse)
    assert ((piece(dq_slots).float() - dq.float()).abs() <= dq.float().abs() * 2 ** -7 + 1e-6).all()
    for x in (slots, dq_slots):
        assert (x[:, :off] == 7.0).all() and (x[:, off + lq:] == 7.0).all()
    assert (slots_lse[:batch * HQ * off] == 7.0).all() and (slots_lse[batch * HQ * (off + lq):] == 7.0).all()


SYNC_CASES = [  # (bench_split case, layout, world size, ring steps per launch)
    ("causal-32k", "zigzag", 8, 1),
    ("causal-32k", "zigzag", 8, 7),
    ("lognormal-s1", "balanced", 8, 1),
    ("lognormal-s1", "balanced", 8, 7),
    ("pareto-s1", "balanced", 4, 3),
    ("pareto-s0", "doczigzag", 4, 1),
]


@pytest.mark.parametrize("case,layout,n,size", SYNC_CASES, ids=str)
def test_a_ring_pass_never_waits_for_the_device(case, layout, n, size):
    """Once a plan's index tensors exist, a ring rank's forward and backward queue their work and
    return without waiting for the device: queued behind a one-second GPU sleep, the pass returns
    while the sleep still runs (an event recorded after the sleep is not yet reached). One wait
    per launch (a copy from host memory, .item(), a blocking copy back) made the grouped ring's
    host time 78 ms a forward (benchmarks/bench_split.py, one H100): the host could no longer run
    ahead of the kernels, nor a training step's other layers. Every rank of bench_split's
    simulated ranks (their real plans, kernels and launches), 1/4 of the lengths, in groups and
    step by step. On one H100 the code before that fix failed here at Pareto s1 N = 4 in groups
    of 3 (rank 0); at these lengths the log-normal N = 8 case's group launches land on float32
    only, so it passed there too."""
    import bench_split as B
    cases = {c.name: c for c in B.build_cases(0.25)}
    point = B.make_point(cases[case], layout, 32, 8, 128, n, "fa4")
    with dtcp.config.override(ring_steps_per_launch=size):
        jobs = B.rank_jobs(point, "ring", torch.device("cuda"), torch.bfloat16)
        assert jobs and all(job.route.steps_per_launch == size for job in jobs)
        with B.local_collectives():
            for job in jobs:
                fwd, bwd = B.job_passes(job, torch.device("cuda"), torch.bfloat16, D ** -0.5)
                bwd(fwd())  # (first use: the plan's launches and their index tensors are made)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1000 * B.sleep_cycles_per_ms()))
                slept = torch.cuda.Event()
                slept.record()
                bwd(fwd())
                waited = slept.query()
                torch.cuda.synchronize()
                assert not waited, (case, layout, n, size, job.rank)
