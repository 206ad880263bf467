"""Documents under the all-gather schedule as one varlen kernel call (schedule.VarlenPlan,
allgather_varlen.py), and batches whose rows have their own documents (cu_seqlens over the
flattened batch, as torchtitan and flash-attn pack them).

Pure Python: the varlen call's sequences, each under one bottom-right window, give exactly the
brute-force mask. Spawned gloo ranks: out, lse, dq, dk, dv against single-process attention with
each row's own mask, float64 to 1e-10; the route taken; compile; error messages."""

from __future__ import annotations

import pytest
import torch

import dtcp
from dist_harness import run_ranks
from dtcp.exec.route import CallArgs, clear_routes, route_for
from dtcp.kernels import KERNELS, default_scale
from dtcp.plan import AttnMask, Band, Task, VarlenPlan, allgather_plans, varlen_reason


def varlen_window(mask):
    return mask.band.window


def window_band(q_len, k_len, window):
    band = Band.from_aligned_window(q_len, k_len, window)
    return band.lo, band.hi
from reference import reference_attention, rel_err, window_doc_mask
from test_window_varlen import assert_exact, sharded_errors

KEYS = ("out", "lse", "dq", "dk", "dv")


# ---- the plan (no process group) -----------------------------------------------------------------

def _segments(cu):
    return tuple((a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a)


def varlen_visible_pairs(plan: VarlenPlan, layout, world_size: int, row: int) -> set:
    """(global query, global key) pairs the varlen call computes for batch row `row`."""
    seq_len = plan.seq_len
    local_to_global = [g for a, b in layout.runs(seq_len, world_size, plan.rank) for g in range(a, b)]
    pairs = set()
    for t in plan.rows[row].tasks:
        lo, hi = window_band(t.q_len, t.k_len, plan.window)
        for i in range(t.q_len):
            for j in range(t.k_len):
                if (lo is None or j - i >= lo) and (hi is None or j - i <= hi):
                    pairs.add((local_to_global[t.q_start + i], t.k_start + j))
    return pairs


@pytest.mark.parametrize("layout", [dtcp.Contiguous(), dtcp.Zigzag()], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("is_causal,window", [(True, (-1, -1)), (True, (3, 0)), (True, (0, 0)), (False, (-1, -1))],
                         ids=str)
def test_varlen_sequences_give_exactly_the_mask(layout, world_size, is_causal, window):
    seq_len = 8 * world_size
    row_cus = [(0, seq_len), (0, 3, 4, 11, seq_len), (0, 1, 2, 3, seq_len - 1, seq_len), (0, 5, 5, 17, seq_len)]
    plans_by_row = [allgather_plans(layout, seq_len // world_size, world_size, is_causal,
                                    AttnMask.make(is_causal, window, _segments(cu))) for cu in row_cus]
    window_br = varlen_window(AttnMask.make(is_causal, window))
    for rank in range(world_size):
        plan = VarlenPlan(tuple(p[rank] for p in plans_by_row), window_br)
        assert plan.rows_tiled
        assert varlen_reason([t for row in plan.rows for t in row.tasks], window_br) is None
        mine = {g for a, b in layout.runs(seq_len, world_size, rank) for g in range(a, b)}
        for row, cu in enumerate(row_cus):
            mask = AttnMask.make(is_causal, window, _segments(cu))
            expected = {(i, j) for i in mine for j in range(seq_len) if mask.visible(i, j)}
            assert varlen_visible_pairs(plan, layout, world_size, row) == expected, (rank, row, cu)


def test_two_sided_windows_are_not_one_varlen_call():
    """A window reaching ahead is cut at document ends, so the sequences' key ranges stop short of
    the bottom-right alignment: one window cannot give every task its band (those calls keep
    the per-task plan or the loop over rows)."""
    plans = allgather_plans(dtcp.Contiguous(), 8, 2, False, AttnMask.make(False, (2, 3), _segments((0, 3, 4, 11, 16))))
    window_br = varlen_window(AttnMask.make(False, (2, 3)))
    assert any(varlen_reason(p.tasks, window_br) is not None for p in plans)


def test_varlen_reason_names_a_task_the_window_cannot_give():
    assert varlen_reason([Task(0, 4, 0, 4, None, 0), Task(4, 8, 0, 8, None, 4)], (-1, 0)) is None
    why = varlen_reason([Task(0, 4, 0, 4, None, 0), Task(4, 8, 0, 8, None, 2)], (-1, 0))
    assert why is not None and "band (None, 2)" in why


# ---- against single-process attention, float64 ----------------------------------------------------

def flatten_row_cus(row_cus, seq_len):
    """Per-row boundaries -> boundaries over the batch flattened row-major (torchtitan's form)."""
    return sorted({b * seq_len + c for b, cu in enumerate(row_cus) for c in cu})


def per_row_errors(layout_spec, row_cus, is_causal=True, window=None, heads=(4, 2), d=8, backend="math",
                   strategy="allgather", one_launch=False, local_len=4, seed=0):
    """On every rank: errors of out, lse, dq, dk, dv against reference attention with each batch
    row's own document mask, and the kind of plan the call took."""
    import torch.distributed as dist

    n = dist.get_world_size()
    s = local_len * n
    hq, hkv = heads
    layout = dtcp.layout_from_spec(layout_spec)
    g = torch.Generator().manual_seed(seed)
    b = len(row_cus)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for row, cu in enumerate(row_cus):
        mask = window_doc_mask(s, is_causal=is_causal, window=window or (-1, -1), cu_seqlens=cu)
        o, l = reference_attention(*(t[row:row + 1] for t in ref), is_causal=is_causal, mask=mask)
        outs.append(o)
        lses.append(l)
    out_ref, lse_ref = torch.cat(outs), torch.cat(lses).detach()
    out_ref.backward(dout)

    cu = torch.tensor(flatten_row_cus(row_cus, s) if len(set(map(tuple, row_cus))) > 1 else row_cus[0],
                      dtype=torch.int32)
    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    kernel = KERNELS[backend] if backend != "auto" else None
    # (set and restored on the class: an instance attribute left behind would shadow the class's
    # setting for every later test in this pooled rank process)
    saved = None if kernel is None else type(kernel).varlen_one_launch
    try:
        if one_launch:
            type(kernel).varlen_one_launch = True  # the route a one-launch kernel (CUDA flash) takes
        clear_routes()
        out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=is_causal, enable_gqa=hq != hkv,
                                       backend=backend, return_lse=True, window_size=window, cu_seqlens=cu,
                                       strategy=strategy)
        out.backward(layout.shard(dout, dim=2))
        scale = default_scale(d)
        args = CallArgs(dist.group.WORLD.group_name, layout.spec(), is_causal, scale, backend,
                        *(window or (-1, -1)), strategy)
        plan = route_for(local[0], local[1], local[2], args, tuple(cu.tolist()), "test").plan
    finally:
        if kernel is not None:
            type(kernel).varlen_one_launch = saved
        clear_routes()
    # fresh contiguous outputs and gradients, as the ops' fake implementations promise (inductor
    # checks the strides of custom op outputs against them)
    for name, t in (("out", out), ("lse", lse), ("dq", local[0].grad), ("dk", local[1].grad), ("dv", local[2].grad)):
        assert t.is_contiguous(), (name, t.shape, t.stride())
    errors = sharded_errors(layout, (out, lse, *(t.grad for t in local)), (out_ref, lse_ref, *(t.grad for t in ref)))
    return {**errors, "plan": type(plan).__name__}


# Rows with their own documents, S = 16 on 4 ranks (8 on 2): one document, many short ones with
# repeated boundaries (empty documents), documents crossing rank and zigzag-chunk boundaries.
ROWS_16 = [[0, 16], [0, 2, 5, 7, 16], [0, 1, 2, 3, 9, 10, 16], [0, 11, 11, 16]]
ROWS_8 = [[0, 8], [0, 3, 8], [0, 1, 2, 7, 8]]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal,window", [(True, None), (True, (3, 0)), (True, (0, 0)), (False, None)], ids=str)
def test_rows_with_own_documents_one_varlen_call(layout, is_causal, window):
    results = run_ranks(4, per_row_errors, layout, ROWS_16, is_causal, window)
    assert_exact(results, (layout, window))
    assert {r["plan"] for r in results} == {"VarlenPlan"}


def test_rows_with_own_documents_two_sided_window():
    results = run_ranks(4, per_row_errors, "contiguous", ROWS_16, False, (2, 1))
    assert_exact(results)
    assert {r["plan"] for r in results} == {"tuple"}  # one call per row (see the pure test above)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
def test_rows_with_own_documents_two_ranks_gqa(heads):
    results = run_ranks(2, per_row_errors, "zigzag", ROWS_8, True, None, heads, d=5, local_len=4)
    assert_exact(results, heads)
    assert {r["plan"] for r in results} == {"VarlenPlan"}


def test_shared_documents_one_launch_route():
    """One mask for every row, with a kernel that runs a varlen call in one launch (on CUDA,
    PyTorch's flash): one call for the batch instead of one per document."""
    rows = [[0, 2, 5, 7, 16]] * 3
    results = run_ranks(4, per_row_errors, "zigzag", rows, True, None, one_launch=True)
    assert_exact(results)
    assert {r["plan"] for r in results} == {"VarlenPlan"}
    # without a one-launch kernel the per-task all-gather plan is kept (as many calls either way)
    results = run_ranks(4, per_row_errors, "zigzag", rows, True, None)
    assert_exact(results)
    assert {r["plan"] for r in results} == {"AllGatherPlan"}


@pytest.mark.parametrize("strategy,backend", [("ring", "auto"), ("ring", "math"), ("ring", "cpu_flash")])
def test_rows_with_own_documents_without_a_varlen_call(strategy, backend):
    """The ring takes the rows one by one (one ring per row): still exact."""
    results = run_ranks(4, per_row_errors, "zigzag", ROWS_16, True, None, backend=backend, strategy=strategy)
    assert_exact(results, (strategy, backend))
    assert {r["plan"] for r in results} == {"tuple"}


def test_rows_with_own_documents_eight_ranks():
    rows = [[0, 32], [0, 5, 9, 30, 32]]
    assert_exact(run_ranks(8, per_row_errors, "zigzag", rows, True, None, local_len=4))


# ---- torch.compile ---------------------------------------------------------------------------------

def compiled_per_row(compile_backend):
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    n = dist.get_world_size()
    s = 4 * n
    layout = dtcp.Zigzag()
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(3, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))

    def attn(q, k, v, cu):
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, cu_seqlens=cu,
                                   backend="math", strategy="allgather")

    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs = []
    # New documents each step, padded to one length with empty documents (repeated boundaries,
    # as packers do): new boundary values must not recompile.
    cus = [flatten_row_cus([[c * s // 16 for c in row] for row in rows], s) for rows in (ROWS_16[1:], ROWS_16[:3])]
    width = max(map(len, cus))
    for cu in cus:
        cu = torch.tensor(cu + [cu[-1]] * (width - len(cu)), dtype=torch.int32)
        grads = []
        for fn in (attn, compiled):
            leaves = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, cu)
            out.backward(layout.shard(dout, dim=2))
            grads.append([out] + [t.grad for t in leaves])
        errs += [rel_err(c, e) for e, c in zip(*grads)]
    return {"max_err": max(errs), "frames": counter.frame_count, "graph_breaks": sum(counters["graph_break"].values())}


def test_rows_with_own_documents_compile_aot_eager():
    for r in run_ranks(4, compiled_per_row, "aot_eager", timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


def test_rows_with_own_documents_compile_inductor():
    """inductor checks the custom op's real output strides against its fake's (a transposed
    output once failed there on GPU, in torchtitan's compiled document-masked run)."""
    for r in run_ranks(2, compiled_per_row, "inductor", timeout=600):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


# ---- bad input -----------------------------------------------------------------------------------

def bad_cu(values, batch=2):
    s = 8 * 2
    q = torch.zeros(batch, 2, 8, 4, dtype=torch.float64)
    try:
        dtcp.ring_attention(q, q, q, layout="zigzag", is_causal=True, cu_seqlens=torch.tensor(values),
                            strategy="allgather")
    except ValueError as e:
        return str(e)
    return f"no error for S={s}"


def test_per_row_cu_seqlens_errors():
    crossing, neither = run_ranks(2, bad_cu, [0, 5, 20, 32]), run_ranks(2, bad_cu, [0, 5, 24])
    assert all("row start" in m and "16 (row 1)" in m for m in crossing), crossing
    assert all("or B*S = 32" in m and "ends at 24" in m for m in neither), neither


# ---- Balanced under the all-gather: one varlen launch for every document piece -----------------------

def balanced_allgather(docs, spec, window=(-1, -1), one_launch=True, compiled=False, steps=1):
    """Balanced (`spec` "balanced[@k]", the boundaries as cu_seqlens) with strategy="allgather" and
    the math kernel taken as a one-launch varlen kernel (the route FA4 and flash take on CUDA):
    errors against one process, the plan the route took, and (compiled) frames and graph breaks.
    `steps` > 1: a new document mix each step (docs rotated), same packed length."""
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    n = dist.get_world_size()
    s = sum(docs)
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    min_chunk = dtcp.layout_from_spec(spec).min_chunk
    kernel = KERNELS["math"]
    saved = type(kernel).varlen_one_launch

    def attn(q, k, v, cu):
        return dtcp.ring_attention(q, k, v, layout=spec, cu_seqlens=cu, is_causal=True, enable_gqa=True,
                                   window_size=window, backend="math", strategy="allgather", return_lse=True)

    counter = CompileCounter()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(attn, backend=counter, fullgraph=True) if compiled else attn
    errors, plans = [], set()
    try:
        type(kernel).varlen_one_launch = one_launch
        clear_routes()
        for step in range(steps):
            mix = docs[step % len(docs):] + docs[:step % len(docs)]
            cu_list = [0]
            for length in mix:
                cu_list.append(cu_list[-1] + length)
            cu = torch.tensor(cu_list, dtype=torch.int32)
            layout = dtcp.Balanced.from_cu_seqlens(cu, min_chunk=min_chunk)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            mask = window_doc_mask(s, is_causal=True, window=window, cu_seqlens=cu_list)
            out_ref, lse_ref = reference_attention(*ref, mask=mask)
            out_ref.backward(dout)
            local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
            out, lse = fn(*local, cu)
            out.backward(layout.shard(dout, dim=2))
            errors.append(sharded_errors(layout, (out, lse, *(t.grad for t in local)),
                                         (out_ref, lse_ref.detach(), *(t.grad for t in ref))))
            args = CallArgs(dist.group.WORLD.group_name, layout.op_spec(), True, default_scale(8), "math", *window,
                            "allgather")
            plans.add(type(route_for(local[0], local[1], local[2], args, tuple(cu_list), "test").plan).__name__)
    finally:
        type(kernel).varlen_one_launch = saved
        clear_routes()
    worst = {key: max(e[key] for e in errors) for key in errors[0]}
    return {**worst, "plans": sorted(plans), "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("n,docs,spec,window", [
    (2, (21, 3, 5, 3), "balanced@1", (-1, -1)),       # the 21 cut in 4 chunks: zigzag pieces of one document
    (4, (40, 3, 3, 2, 9, 7), "balanced@1", (5, 0)),   # a window, with the 40 cut in 8 chunks
    (4, (40, 3, 3, 2, 9, 7), "balanced", (-1, -1)),   # nothing cut: documents split only at rank ends
], ids=["n2_cut", "n4_window", "n4_whole"])  # (8 ranks: tests/test_simulated_ring.py, in one process)
def test_balanced_allgather_one_varlen_launch(n, docs, spec, window):
    results = run_ranks(n, balanced_allgather, docs, spec, window)
    assert_exact(results, (docs, spec, window))
    assert {p for r in results for p in r["plans"]} == {"VarlenPlan"}


def test_balanced_allgather_new_documents_every_batch_compiled():
    """Compiled (aot_eager): a new document mix every step is neither a graph break nor a recompile."""
    results = run_ranks(2, balanced_allgather, (20, 3, 5, 4), "balanced@1", (-1, -1), True, True, 4, timeout=300)
    assert_exact(results)
    for r in results:
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r


def balanced_allgather_kernel_ignores_outputs(docs, spec):
    """balanced_allgather with a kernel whose varlen calls ignore the tensors they are asked to
    write into (as an FA4 without `out=` would) and return fresh ones: the all-gather's in-place
    results (one batch row: out, lse, dQ) must still be written, by a copy. Also counts the calls
    that were handed output tensors."""
    from dtcp.kernels.math import MathKernel
    calls = {"forward_into": 0, "backward_into": 0}

    def forward_ignoring(self, q, k, v, seqs, window, scale, out, lse, softcap=None, sink=None):
        calls["forward_into"] += out is not None
        return self.varlen_forward(q, k, v, seqs, window, scale, softcap=softcap, sink=sink)

    def backward_ignoring(self, dout, q, k, v, out, lse, seqs, window, scale, softcap=None, dq=None, dk=None,
                          dv=None):
        calls["backward_into"] += dq is not None
        return self.varlen_backward(dout, q, k, v, out, lse, seqs, window, scale, softcap=softcap)

    saved = MathKernel.varlen_forward_into, MathKernel.varlen_backward_into
    MathKernel.varlen_forward_into, MathKernel.varlen_backward_into = forward_ignoring, backward_ignoring
    try:
        return {**balanced_allgather(docs, spec), **calls}
    finally:
        MathKernel.varlen_forward_into, MathKernel.varlen_backward_into = saved


def test_balanced_allgather_when_the_kernel_ignores_its_output_tensors():
    """One batch row: the varlen all-gather hands the kernel its results to write into; a kernel
    that returns others instead gets them copied in (dtcp.kernels.base.landed), exact to 1e-10."""
    docs, spec = (21, 3, 5, 3), "balanced@1"
    results = run_ranks(2, balanced_allgather_kernel_ignores_outputs, docs, spec)
    assert_exact(results, (docs, spec))
    for r in results:
        assert r["forward_into"] >= 1 and r["backward_into"] >= 1, r


def balanced_allgather_error():
    try:
        balanced_allgather((21, 3, 5, 3), "balanced@1", one_launch=False)
    except ValueError as e:
        return str(e)
    return "no error"


def test_balanced_allgather_without_a_one_launch_kernel_is_refused():
    """Per-task calls would be one kernel call per document piece: refused on every rank, naming the fix."""
    for msg in run_ranks(2, balanced_allgather_error):
        assert "strategy='allgather'" in msg and "one varlen launch" in msg and "strategy='ring'" in msg, msg
