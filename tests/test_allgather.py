"""The all-gather schedule (strategy="allgather"): its plans against brute-force masks (pure
Python), the auto rule, and its results against single-process attention on spawned gloo ranks
(float64 to 1e-10; bfloat16 within 1.5x the kernel's own error), eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from dtcp.comm import STATS
from dtcp.exec.route import CallArgs, _plans_and_kernel
from dtcp.plan import (
    AttnMask,
    allgather_plans,
    allgather_reason,
    exchange_candidates,
)

ALLGATHER_AUTO_MAX_BYTES = dtcp.config.allgather_max_bytes


def choose_exchange(*args):
    """The exchange auto tries first (the ring is always its fallback)."""
    return exchange_candidates(*args, ALLGATHER_AUTO_MAX_BYTES)[0]
from reference import rel_err
from test_compile import compiled_vs_eager
from test_ring import ring_errors
from test_window_varlen import assert_exact, masked_errors

KEYS = ("out", "lse", "dq", "dk", "dv")


# ---- the plan (no process group) -----------------------------------------------------------------

def check_allgather_plans(layout, world_size, seq_len, mask):
    """Every (local query, global key) pair the mask allows is computed exactly once, nothing
    else is, query ranges are disjoint and sorted, and tasks are trimmed."""
    local_len = seq_len // world_size
    plans = allgather_plans(layout, local_len, world_size, False, mask)
    # the pieces, slices of the ranks' shards, are the sequence in order
    p0 = plans[0]
    shards = [layout.global_positions(seq_len, world_size, r).tolist() for r in range(world_size)]
    assert [g for rank, lo, hi in p0.pieces for g in shards[rank][lo:hi]] == list(range(seq_len))
    assert all(a[0] != b[0] or a[2] != b[1] for a, b in zip(p0.pieces, p0.pieces[1:]))  # maximal
    for rank, plan in enumerate(plans):
        assert plan.pieces == p0.pieces
        q_pos = layout.global_positions(seq_len, world_size, rank).tolist()
        count = torch.zeros(local_len, seq_len, dtype=torch.int64)
        end = 0
        for t in plan.tasks:
            assert t.q_start >= end, plan.tasks  # disjoint, sorted query ranges: no merge needed
            end = t.q_end
            rows = [any(t.visible(i, j) for j in range(t.k_len)) for i in range(t.q_len)]
            cols = [any(t.visible(i, j) for i in range(t.q_len)) for j in range(t.k_len)]
            assert all(rows) and all(cols), t
            for i in range(t.q_len):
                for j in range(t.k_len):
                    if t.visible(i, j):
                        count[t.q_start + i, t.k_start + j] += 1
        truth = torch.tensor([[mask.visible(qi, kj) for kj in range(seq_len)] for qi in q_pos], dtype=torch.int64)
        assert torch.equal(count, truth), (layout, world_size, rank, mask)
        assert plan.rows_tiled == bool(truth.any(1).all())  # disjoint tasks: tiled iff every row is seen


LAYOUTS = [dtcp.Contiguous(), dtcp.Zigzag()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mask", [
    AttnMask.make(True), AttnMask.make(False), AttnMask.make(True, (3, 0)), AttnMask.make(False, (2, 5)),
], ids=["causal", "full", "window_3_0", "window_2_5"])
def test_allgather_plan_covers_exactly_the_visible_pairs(layout, world_size, mask):
    check_allgather_plans(layout, world_size, layout.multiple(world_size) * 2, mask)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mask", [
    AttnMask.make(True, (-1, -1), ((0, 3), (3, 10), (12, 16))), AttnMask.make(False, (1, 1), ((2, 9),)),
], ids=["docs_causal", "doc_window_padding"])
def test_allgather_plan_with_documents(layout, world_size, mask):
    check_allgather_plans(layout, world_size, 16, mask)


def test_allgather_plan_of_causal_zigzag_is_two_calls_per_rank():
    """Zigzag, causal, 4 ranks of 8 tokens (chunks of 4): rank r's low chunk r sees chunks 0..r,
    its high chunk 7-r sees chunks 0..7-r; each is one bottom-right causal call."""
    plans = allgather_plans(dtcp.Zigzag(), 8, 4, True)
    # chunks in sequence order: rank 0's, 1's, 2's, 3's low chunks, then the high ones back down
    # (rank 3's two chunks touch: one piece)
    assert plans[0].pieces == ((0, 0, 4), (1, 0, 4), (2, 0, 4), (3, 0, 8), (2, 4, 8), (1, 4, 8), (0, 4, 8))
    for r, plan in enumerate(plans):
        low, high = plan.tasks
        assert (low.q_start, low.q_end, low.k_start, low.k_end, low.lo, low.hi) == (0, 4, 0, 4 * (r + 1), None, 4 * r)
        assert (high.q_start, high.q_end, high.k_start, high.k_end) == (4, 8, 0, 4 * (8 - r))
        assert (high.lo, high.hi) == (None, 4 * (7 - r))
        assert plan.rows_tiled


def test_key_writes_copy_each_keys_first_share_add_the_rest_zero_the_unseen():
    """AllGatherPlan.key_writes, against a count per key, on random task sets and on real plans:
    each task's runs tile its keys in order; a run is `first` exactly where no earlier task has
    those keys (copied in, the bits a zeroed sum gives), and the unseen keys are the ones no task
    has. The backward sums dK/dV by these writes instead of a zero fill and adds."""
    import random

    from dtcp.plan.allgather import AllGatherPlan
    from dtcp.plan.mask import Task

    def check(plan):
        writes, unseen = plan.key_writes
        count = [0] * plan.seq_len
        for task, runs in zip(plan.tasks, writes):
            pos = task.k_start
            for a, c, first in runs:
                assert a == pos < c
                assert all((count[key] == 0) == first for key in range(a, c)), (plan.tasks, writes)
                pos = c
            assert pos == task.k_end
            for key in range(task.k_start, task.k_end):
                count[key] += 1
        assert [key for a, c in unseen for key in range(a, c)] == [key for key in range(plan.seq_len) if not count[key]]
        return count

    rng = random.Random(0)
    for _ in range(3000):
        s = rng.randint(1, 40)
        spans = [sorted((rng.randint(0, s), rng.randint(0, s))) for _ in range(rng.randint(0, 5))]
        check(AllGatherPlan(1, 0, s, ((0, 0, s),), tuple(Task(i, i + 1, a, c) for i, (a, c) in enumerate(spans))))
    # causal zigzag, 4 ranks of 8 (chunks of 4): the low chunk's keys are copied, the high chunk
    # adds onto them and copies the rest of its prefix; the keys after it are unseen
    for r, plan in enumerate(allgather_plans(dtcp.Zigzag(), 8, 4, True)):
        check(plan)
        low, high = 4 * (r + 1), 4 * (8 - r)
        assert plan.key_writes == ((((0, low, True),), ((0, low, False), (low, high, True))),
                                   () if r == 0 else ((high, 32),))
    # causal contiguous: rank 0 sees only its own keys; the rest of the sequence is zeroed
    assert allgather_plans(dtcp.Contiguous(), 8, 4, True)[0].key_writes == ((((0, 8, True),),), ((8, 32),))


def test_allgather_refuses_layouts_with_many_runs():
    assert allgather_reason(dtcp.Zigzag(), 8, 4) is None and allgather_reason(dtcp.Contiguous(), 5, 3) is None
    why = allgather_reason(dtcp.Striped(1), 8, 4)
    assert why is not None and "8 separate runs" in why
    assert "unequal lengths" in allgather_reason(dtcp.DocZigzag((5, 11)), 8, 2)
    # as one varlen launch (documents, a one-launch kernel), any layout
    assert allgather_reason(dtcp.DocZigzag((5, 11)), 8, 2, one_launch=True) is None
    assert allgather_reason(dtcp.Balanced((21, 3, 5, 3), min_chunk=1), 16, 2, one_launch=True) is None
    # the plans themselves exist for any layout; the route refuses what no kernel call can take
    check_allgather_plans(dtcp.Striped(2), 2, 16, AttnMask.make(True))
    check_allgather_plans(dtcp.Balanced((21, 3, 5, 3), min_chunk=1), 2, 32, AttnMask.make(True, (-1, -1), (
        (0, 21), (21, 24), (24, 29), (29, 32))))
    check_allgather_plans(dtcp.Balanced((50, 3, 30, 1, 6, 2, 4), min_chunk=2), 8, 96, AttnMask.make(True, (5, 0), (
        (0, 50), (50, 53), (53, 83), (83, 84), (84, 90), (90, 92), (92, 96))))
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="Use strategy='ring'"):
        _plans_and_kernel("allgather", dtcp.Striped(2), q, q, q, CallArgs("", "striped", True, 0.5, "auto", -1, -1,
                                                                           "allgather"), (None,), 2, False)


def test_auto_rule():
    z, c, s1 = dtcp.Zigzag(), dtcp.Contiguous(), dtcp.Striped(1)
    small, big = ALLGATHER_AUTO_MAX_BYTES, ALLGATHER_AUTO_MAX_BYTES + 1
    assert choose_exchange("auto", z, 1024, 2, "cuda", small) == "allgather"
    assert choose_exchange("auto", c, 1024, 4, "cuda", small) == "allgather"
    assert choose_exchange("auto", z, 1024, 2, "cuda", big) == "ring"       # large: overlap wins
    assert choose_exchange("auto", s1, 1024, 2, "cuda", small) == "ring"    # one call per stripe
    assert choose_exchange("auto", z, 1024, 2, "cpu", small) == "ring"      # CPU: the ring
    assert choose_exchange("auto", z, 1024, 1, "cuda", small) == "ring"     # nothing to gather
    assert choose_exchange("allgather", z, 1024, 2, "cpu", big) == "allgather"
    assert choose_exchange("ring", z, 1024, 2, "cuda", small) == "ring"
    with pytest.raises(ValueError, match="exchange must be one of"):
        choose_exchange("p2p", z, 1024, 2, "cuda", small)


# ---- against single-process attention, float64 ----------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (3, 1)], ids=["mha", "gqa8-2", "mqa3-1"])
def test_allgather_exact_float64(world_size, layout, is_causal, heads):
    hq, hkv = heads
    d = 5 if hq == 3 else 16
    results = run_ranks(world_size, ring_errors, layout, is_causal, 2, hq, hkv, 8 * world_size, d, "float64",
                        "math", 0, "allgather")
    for key in KEYS:
        assert max(r[key] for r in results) < 1e-10, (key, [r[key] for r in results])


def test_allgather_exact_world8():
    results = run_ranks(8, ring_errors, "zigzag", True, 2, 8, 2, 32, 8, "float64", "auto", 0, "allgather")
    for key in KEYS:
        assert max(r[key] for r in results) < 1e-10, (key, [r[key] for r in results])


@pytest.mark.parametrize("world_size", [2, 4])
def test_allgather_low_precision_within_kernel_error(world_size):
    """bfloat16: each query row is one kernel call over all of its keys, so the error against
    float64 stays within 1.5x the same kernel's own error over the whole sequence, at any N."""
    results = run_ranks(world_size, ring_errors, "zigzag", True, 1, 8, 2, 128, 32, "bfloat16", "math", 0,
                        "allgather")
    for key in KEYS:
        ratios = [r[key] / r["kernel"][key] for r in results]
        assert max(ratios) <= 1.5, (key, ratios)


@pytest.mark.parametrize("window,is_causal", [((0, 0), True), ((2, 0), True), ((6, 0), True), ((40, 0), True),
                                              ((1, 2), False), ((5, 6), False), ((-1, 3), False)], ids=str)
def test_allgather_windows_contiguous(window, is_causal):
    assert_exact(run_ranks(4, masked_errors, "contiguous", 16, is_causal, window, strategy="allgather"), window)


@pytest.mark.parametrize("cu", [[0, 2, 5, 7, 16], [0, 11, 16], [0, 1, 2, 3, 9, 10, 16]], ids=str)
@pytest.mark.parametrize("layout,window,is_causal", [
    ("contiguous", (-1, -1), True), ("contiguous", (1, 2), False), ("zigzag", (6, 0), True), ("zigzag", None, False),
], ids=str)
def test_allgather_documents(cu, layout, window, is_causal):
    assert_exact(run_ranks(4, masked_errors, layout, 16, is_causal, window, cu, strategy="allgather"),
                 (cu, layout, window))


# ---- what travels --------------------------------------------------------------------------------

def allgather_traffic(strategy, fast_path=True):
    n = dist.get_world_size()
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    with dtcp.config.override(eager_fast_path=fast_path):
        STATS.reset()
        out = dtcp.ring_attention(q, k, v, is_causal=True, enable_gqa=True, strategy=strategy)
        fwd = (STATS.kv_rounds, STATS.kv_bytes_sent)
        out.sum().backward()
    kv_bytes = 2 * k.numel() * k.element_size()
    return {"fwd": fwd, "total": (STATS.kv_rounds, STATS.kv_bytes_sent, STATS.grad_rounds, STATS.grad_bytes_sent),
            "kv_bytes": kv_bytes, "n": n}


def test_allgather_sends_kv_once_per_pass_with_kv_heads():
    """Forward: one all-gather of this rank's K/V (GQA: 2 K/V heads, not 4). Backward: one float64
    reduce-scatter of dK/dV, and no second all-gather on the eager path (it keeps the gathered
    K/V); the custom op (compiled code) gathers again. On CPU `auto` stays on the ring."""
    for r in run_ranks(4, allgather_traffic, "allgather"):
        kvb, n = r["kv_bytes"], r["n"]
        assert r["fwd"] == (1, (n - 1) * kvb)
        assert r["total"] == (1, (n - 1) * kvb, 1, (n - 1) * kvb)
    for r in run_ranks(4, allgather_traffic, "allgather", False):
        kvb, n = r["kv_bytes"], r["n"]
        assert r["total"] == (2, 2 * (n - 1) * kvb, 1, (n - 1) * kvb)
    for r in run_ranks(4, allgather_traffic, "auto"):
        assert r["fwd"][0] == r["n"] - 1  # the ring's N - 1 rounds


# ---- compiled -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_allgather_compile_aot_eager(layout):
    for r in run_ranks(2, compiled_vs_eager, "aot_eager", layout, strategy="allgather", timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


def ring_vs_allgather():
    """Both exchanges give the same answer (float64, to rounding)."""
    torch.manual_seed(dist.get_rank())
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    res = {}
    for x in ("ring", "allgather"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = dtcp.ring_attention(*leaves, is_causal=True, enable_gqa=True, return_lse=True, strategy=x,
                                       window_size=(7, 0), layout="contiguous")
        out.backward(torch.cos(out.detach()))
        res[x] = [out, lse] + [t.grad for t in leaves]
    return max(rel_err(a, b) for a, b in zip(res["ring"], res["allgather"]))


def test_ring_and_allgather_agree():
    assert max(run_ranks(3, ring_vs_allgather)) < 1e-12


def compiled_graph_ops(strategy, dtype_name="float64"):
    """Compile TinyAttention with a backend that records the forward and backward graphs AOT
    autograd hands to the compiler; return which communication and attention ops they call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from test_compile import TinyAttention

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention(layout="zigzag", strategy=strategy).to(getattr(torch, dtype_name))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    x = torch.randn(2, 8, 16, dtype=getattr(torch, dtype_name))
    compiled(x).square().sum().backward()
    text = "\n".join(graphs)
    return {
        "graphs": len(graphs),
        "custom_op": "dtcp.ring_attention_forward" in text or "dtcp.ring_attention_backward" in text,
        "all_gather": "all_gather_into_tensor" in text,
        "reduce_scatter": "reduce_scatter_tensor" in text,
    }


def test_compiled_allgather_is_traced_into_the_graph():
    """Compiled, the all-gather schedule becomes graph code (a functional all-gather forward, its
    reduce-scatter backward), not the opaque custom op; the ring stays the custom op."""
    for r in run_ranks(2, compiled_graph_ops, "allgather", timeout=300):
        assert r == {"graphs": 2, "custom_op": False, "all_gather": True, "reduce_scatter": True}, r
    for r in run_ranks(2, compiled_graph_ops, "ring", timeout=300):
        assert r["custom_op"] and not r["all_gather"], r


def test_allgather_compile_inductor():
    """Twice: the second compile finds the first's artifacts in torch.compile's caches. The traced
    graph differs between ranks while the graph the caches key on did not (until the op took the
    rank as an argument), and a rank then ran another rank's graph: errors of order 1."""
    for _ in range(2):
        results = run_ranks(2, compiled_vs_eager, "inductor", "zigzag", dtype_name="float32",
                            strategy="allgather", timeout=600)
        for r in results:
            assert r["graph_breaks"] == 0 and r["frames"] == 1, r
            assert r["max_err"] < 1e-5, r


def compiled_allgather_window_and_documents():
    """Windows and documents have no traced form: compiled, they take the custom op (through
    the same routing op) and still equal eager, with no graph break."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(dist.get_rank())
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    n = dist.get_world_size()
    cu = torch.tensor([0, 3, 8 * n], dtype=torch.int32)

    def attn(q, k, v, cu):
        a = dtcp.ring_attention(q, k, v, layout="contiguous", is_causal=True, enable_gqa=True, window_size=(5, 0),
                                strategy="allgather")
        b = dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, enable_gqa=True, cu_seqlens=cu,
                                strategy="allgather")
        return a + b

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs = []
    for fn in (attn, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu)
        out.backward(torch.cos(out.detach()))
        errs.append([out.detach()] + [t.grad for t in leaves])
    return {"err": max(rel_err(a, b) for a, b in zip(*errs)), "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values())}


def test_compiled_allgather_with_window_and_documents():
    for r in run_ranks(2, compiled_allgather_window_and_documents, timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1 and r["err"] < 1e-12, r


def compiled_low_precision_errors(world_size_unused=None):
    """bfloat16 through the compiled (traced) all-gather: errors against float64 and the math
    kernel's own errors over the whole sequence, on this rank's rows."""
    from reference import reference_attention
    from test_ring import kernel_errors, make_inputs

    layout = dtcp.Zigzag()
    q, k, v, dout = make_inputs(11, 1, 8, 2, 128, 32)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, is_causal=True)
    out_ref.backward(dout)
    shard = lambda t: layout.shard(t, dim=2)  # noqa: E731

    def attn(q, k, v):
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, backend="math",
                                   return_lse=True, strategy="allgather")

    torch._dynamo.reset()
    local = [shard(t).to(torch.bfloat16).detach().requires_grad_() for t in (q, k, v)]
    out, lse = torch.compile(attn, backend="aot_eager", fullgraph=True)(*local)
    out.backward(shard(dout).to(torch.bfloat16))
    errs = {"out": rel_err(out, shard(out_ref)), "lse": rel_err(lse, shard(lse_ref)),
            "dq": rel_err(local[0].grad, shard(ref[0].grad)), "dk": rel_err(local[1].grad, shard(ref[1].grad)),
            "dv": rel_err(local[2].grad, shard(ref[2].grad))}
    own = kernel_errors(q, k, v, dout, out_ref, lse_ref, ref, True, torch.bfloat16, "math", shard)
    return {key: errs[key] / own[key] for key in KEYS}


def test_compiled_allgather_low_precision_within_kernel_error():
    for r in run_ranks(2, compiled_low_precision_errors, timeout=300):
        assert max(r.values()) <= 1.5, r


def test_traceable_band_mask_equals_the_cached_one():
    from dtcp.kernels import band_mask, band_mask_traceable

    for lq, lk in ((4, 4), (3, 7), (7, 3)):
        for lo, hi in ((None, None), (None, 0), (None, 4), (-2, 0), (0, 3), (-5, None), (1, 2)):
            a, b = band_mask(lq, lk, lo, hi, "cpu"), band_mask_traceable(lq, lk, lo, hi, "cpu")
            assert (a is None and b is None) or torch.equal(a, b), (lq, lk, lo, hi)
