"""Ulysses (heads exchanged for tokens by all-to-all) and hybrid (Ulysses inside the groups of a 2-D
mesh, ring or all-gather across them): float64 exactness against dense single-process attention
(out, lse, dq, dk, dv, dsinks) on 2, 3 and 4 ranks and a 2x2 mesh, every layout, causal, windows,
documents, softcap, sinks, a value head dim of its own and GQA with K/V heads replicated; the head
plan's pure index math; compile; communication counts; errors on every rank; the cost model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from dtcp.layouts import Grouped
from dtcp.plan import CallShape, MACHINES, Task, head_splits, predict, task_pairs, ulysses_plan
from test_softcap_sinks import assert_exact, errors


# ---- pure: the head plan and the grouped layout ---------------------------------------------------
@pytest.mark.parametrize("layout", [dtcp.Contiguous(), dtcp.Zigzag(), dtcp.Striped(1), dtcp.Striped(3)])
@pytest.mark.parametrize("u,r", [(2, 1), (4, 1), (3, 1), (2, 2), (2, 3), (3, 2)])
def test_head_plan_gathers_the_group_tokens_in_order(layout, u, r):
    """Simulate the exchange on positions: the gathered sequence of each head group is exactly
    the inner layout's shard, in increasing global order, and the pieces tile both sides."""
    n = u * r
    local_len = layout.multiple(n) * 2
    seq_len = local_len * n
    for cp_rank in range(n):
        plan = ulysses_plan(layout, local_len, u, r, cp_rank, 2 * u, u, "test")
        outer = cp_rank // u
        shards = [layout.global_positions(seq_len, n, outer * u + j) for j in range(u)]
        gathered = torch.full((plan.gathered_len,), -1, dtype=torch.long)
        covered = [torch.zeros(local_len, dtype=torch.bool) for _ in range(u)]
        for j, src, dst, length in plan.pieces:
            assert (gathered[dst:dst + length] == -1).all()
            gathered[dst:dst + length] = shards[j][src:src + length]
            assert not covered[j][src:src + length].any()
            covered[j][src:src + length] = True
        assert all(c.all() for c in covered)
        want = Grouped(layout, u).global_positions(seq_len, r, outer) if r > 1 else torch.arange(seq_len)
        assert torch.equal(gathered, want), (layout, u, r, cp_rank)
        assert (torch.diff(gathered) > 0).all()


def test_grouped_layout_is_the_union_of_its_members():
    z = Grouped(dtcp.Zigzag(), 2)
    assert z.runs(32, 2, 0) == [(0, 8), (24, 32)]  # zigzag of 4 ranks, chunks {0,7} + {1,6}
    assert z.runs(32, 2, 1) == [(8, 24)]
    assert dtcp.layout_from_spec(z.spec()) == z
    assert Grouped(dtcp.Contiguous(), 3).runs(12, 2, 1) == [(6, 12)]
    with pytest.raises(ValueError, match="inner must be a positive int"):
        Grouped(dtcp.Zigzag(), 0)


def test_head_splits_replicate_kv_heads_only_as_far_as_needed():
    q, kv = head_splits(8, 2, 4, "x")
    assert (q.per_rank, kv.per_rank, kv.replicas) == (2, 1, 2)
    assert [kv.first_head(u) for u in range(4)] == [0, 0, 1, 1]  # query heads 2u, 2u+1 use kv head u // 2
    q, kv = head_splits(8, 8, 4, "x")
    assert (kv.per_rank, kv.replicas) == (2, 1)
    with pytest.raises(ValueError, match="6 query heads over the 4 ranks.*strategy='ring'"):
        head_splits(6, 2, 4, "strategy='ulysses'")
    with pytest.raises(ValueError, match="3 key/value heads over the 2 ranks"):
        head_splits(6, 3, 2, "strategy='ulysses'")


# ---- exactness, float64 -----------------------------------------------------------------------------
ULYSSES_CASES = [
    # (world, layout, features, heads)
    (2, "zigzag", {}, (4, 2)),
    (2, "contiguous", {"window": (5, 0)}, (4, 2)),
    (2, "striped:1", {"cu": [0, 5, 16, 23, 32]}, (4, 4)),
    (2, "zigzag", {"softcap": 2.5, "with_sinks": True}, (4, 2)),
    (2, "zigzag", {"is_causal": False, "window": (3, 4)}, (4, 2)),
    (2, "contiguous", {"d": 12, "dv": 8, "backend": "math"}, (4, 2)),
    (3, "zigzag", {}, (6, 3)),
    (3, "contiguous", {"cu": [0, 7, 30, 48], "with_sinks": True}, (6, 1)),  # 1 kv head on 3 ranks: replicated
    (4, "zigzag", {}, (8, 2)),  # 2 kv heads on 4 ranks: each replicated twice, dk/dv summed
    (4, "striped:1", {"window": (6, 0), "softcap": 3.0}, (4, 4)),
    (4, "contiguous", {"cu": [0, 9, 10, 40, 64]}, (8, 8)),
]


@pytest.mark.parametrize("world,layout,features,heads", ULYSSES_CASES)
def test_ulysses_exact_float64(world, layout, features, heads):
    s = 16 * world if world != 3 else 48
    results = run_ranks(world, ulysses_errors, layout, s, heads=heads, **features)
    assert_exact(results, (world, layout, features, heads))
    for r in results:  # heads moved (out and back, twice); K/V never did
        assert r["heads_rounds"] == 4 and r["kv_rounds"] == 0 and r["grad_rounds"] == 0, r


def ulysses_errors(layout_spec, s, **kw):
    dtcp.comm_stats.reset()
    result = errors(layout_spec, s, strategy="ulysses", **kw)
    stats = dtcp.comm_stats
    result.update(heads_rounds=stats.heads_rounds, kv_rounds=stats.kv_rounds, grad_rounds=stats.grad_rounds)
    return result


def hybrid_errors(layout_spec, s, as_mesh, allgather_across=False, **kw):
    """errors() on a 2x2 mesh (ring dim 0, Ulysses dim 1): as a DeviceMesh or as a group pair.
    `allgather_across`: the exchange across the Ulysses groups is the all-gather (what "auto"
    takes on CUDA for short sequences; on CPU it takes the ring)."""
    from dist_harness import _hybrid_groups
    from dtcp.exec import route as route_mod

    group = _hybrid_groups(as_mesh)
    saved = route_mod.exchange_candidates
    if allgather_across:
        route_mod.exchange_candidates = lambda requested, *a: ("allgather", "ring")
        route_mod.clear_routes()
    try:
        dtcp.comm_stats.reset()
        result = errors(layout_spec, s, group=group, strategy="hybrid", **kw)
        result["heads_rounds"], result["kv_rounds"] = dtcp.comm_stats.heads_rounds, dtcp.comm_stats.kv_rounds
        return result
    finally:
        route_mod.exchange_candidates = saved
        route_mod.clear_routes()


HYBRID_CASES = [
    ("zigzag", {}, (4, 2), True),
    ("contiguous", {"window": (9, 0)}, (4, 2), False),
    ("striped:1", {"cu": [0, 13, 14, 40, 64]}, (4, 4), True),
    ("zigzag", {"softcap": 2.0, "with_sinks": True}, (4, 1), False),  # 1 kv head over U = 2: replicated
    ("zigzag", {"allgather_across": True}, (4, 2), True),
    ("contiguous", {"allgather_across": True, "cu": [0, 20, 64], "window": (7, 0)}, (4, 2), False),
]


@pytest.mark.parametrize("layout,features,heads,as_mesh", HYBRID_CASES)
def test_hybrid_2x2_exact_float64(layout, features, heads, as_mesh):
    results = run_ranks(4, hybrid_errors, layout, 64, as_mesh, heads=heads, **features)
    assert_exact(results, (layout, features, heads, as_mesh))
    for r in results:  # heads were exchanged (forward out and back, backward out and back), and K/V moved across
        assert r["heads_rounds"] == 4 and r["kv_rounds"] >= 1, r


# ---- what moves ----------------------------------------------------------------------------------
def ulysses_traffic(hq, hkv, d):
    n = dist.get_world_size()
    b, s = 2, 8 * n
    q = torch.randn(b, hq, s // n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, s // n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, s // n, d, dtype=torch.float64, requires_grad=True)
    dtcp.comm_stats.reset()
    out = dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, enable_gqa=hq != hkv, strategy="ulysses")
    fwd = (dtcp.comm_stats.heads_rounds, dtcp.comm_stats.heads_bytes_sent, dtcp.comm_stats.kv_rounds)
    out.sum().backward()
    bwd = (dtcp.comm_stats.heads_rounds - fwd[0], dtcp.comm_stats.heads_bytes_sent - fwd[1],
           dtcp.comm_stats.kv_rounds + dtcp.comm_stats.grad_rounds)
    return {"fwd": fwd, "bwd": bwd}


@pytest.mark.parametrize("world,hq,hkv", [(2, 4, 2), (4, 8, 2)])
def test_ulysses_sends_what_the_model_counts(world, hq, hkv):
    """Forward: one all-to-all out (q, k, v; K/V heads replicated to U when fewer) and one back
    (out, lse); backward: dout out, dq/dk/dv back (replicated K/V gradients in float32). No K/V
    rounds. Bytes: each rank sends (U-1)/U of each tensor (rows 16-byte aligned)."""
    d, b, n = 8, 2, world
    local = 8  # tokens per rank
    per = lambda heads, e: b * heads * local * d * e // n  # noqa: E731  one destination's part
    kv_sent = max(hkv, n)
    fwd_out = per(hq, 8) + 2 * per(kv_sent, 8)
    fwd_back = per(hq, 8) + b * hq * local * 8 // n  # out + lse
    bwd_out = per(hq, 8)
    bwd_back = per(hq, 8) + 2 * per(kv_sent, 8)
    for r in run_ranks(world, ulysses_traffic, hq, hkv, d):
        assert r["fwd"] == (2, (n - 1) * (fwd_out + fwd_back), 0), r
        assert r["bwd"] == (2, (n - 1) * (bwd_out + bwd_back), 0), r


# ---- compile -------------------------------------------------------------------------------------
def compiled_strategy(strategy, dynamic):
    from torch._dynamo.utils import counters

    n = dist.get_world_size()
    group = None
    if strategy == "hybrid":
        from dist_harness import _hybrid_groups

        group = _hybrid_groups(True)
    torch._dynamo.reset()
    counters.clear()
    layout = dtcp.Zigzag()

    def attn(q, k, v):
        return dtcp.ring_attention(q, k, v, group, layout=layout, is_causal=True, enable_gqa=True, strategy=strategy)

    fn = torch.compile(attn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    errs = []
    for s in (8 * n, 16 * n, 24 * n):  # lengths that change between steps
        g = torch.Generator().manual_seed(s)
        full = [torch.randn(2, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
        local = [layout.shard(t, group, dim=2) for t in full]
        eager_in = [t.clone().requires_grad_() for t in local]
        comp_in = [t.clone().requires_grad_() for t in local]
        want = attn(*eager_in)
        want.square().sum().backward()
        got = fn(*comp_in)
        got.square().sum().backward()
        errs.append(max((a - b).abs().max().item() for a, b in
                        zip([got] + [t.grad for t in comp_in], [want] + [t.grad for t in eager_in])))
    frames = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return {"errs": errs, "graphs": frames, "breaks": breaks}


@pytest.mark.parametrize("strategy,world", [("ulysses", 2), ("hybrid", 4)])
def test_compiled_equals_eager(strategy, world):
    for r in run_ranks(world, compiled_strategy, strategy, None, timeout=600):
        assert r["breaks"] == 0, r
        assert max(r["errs"]) == 0.0, r  # the same executors run: bit for bit
        assert r["graphs"] <= 2, r  # the first length, then one dynamic graph for the others


# ---- errors on every rank ------------------------------------------------------------------------
def bad_heads():
    n = dist.get_world_size()
    q = torch.randn(1, 6, 8, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    try:
        dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, strategy="ulysses")
    except Exception as e:  # noqa: BLE001
        first = f"{type(e).__name__}: {e}"
    else:
        first = None
    # a rank that differs: only rank 0 asks for Ulysses
    try:
        q4 = torch.randn(1, 4, 8, 8, dtype=torch.float64)
        dtcp.ring_attention(q4, q4.clone(), q4.clone(), strategy="ulysses" if dist.get_rank() == 0 else "ring")
    except Exception as e:  # noqa: BLE001
        second = f"{type(e).__name__}: {e}"
    else:
        second = None
    return {"first": first, "second": second, "n": n}


def test_ulysses_errors_raise_on_every_rank():
    for r in run_ranks(4, bad_heads):
        assert "6 query heads over the 4 ranks" in r["first"] and "strategy='ring'" in r["first"], r
        assert r["second"] is not None and "strategy" in r["second"], r


# ---- the cost model ------------------------------------------------------------------------------
def test_task_pairs_is_exact():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        ql, kl = rng.randint(1, 12), rng.randint(1, 12)
        lo = rng.choice([None] + list(range(-14, 14)))
        hi = rng.choice([None] + list(range(-14, 14)))
        t = Task(0, ql, 0, kl, lo, hi)
        brute = sum(1 for i in range(ql) for j in range(kl)
                    if (lo is None or j - i >= lo) and (hi is None or j - i <= hi))
        assert task_pairs(t) == brute, (ql, kl, lo, hi)


def test_cost_model_orders_what_it_should():
    m = MACHINES["h200-nvlink"]
    base = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128, v_head_dim=128, elem_bytes=2, world_size=2)

    def shape(s, rounds=1, window=None):
        n, local = 2, s // 2
        pairs_total = s * s / 2 if window is None else s * window
        return CallShape(**base, local_len=local, ring_pairs=pairs_total / n, ring_rounds=rounds, ring_calls=3,
                         ring_q_block=local // 2, allgather_pairs=pairs_total / n, allgather_calls=2,
                         total_pairs=pairs_total)

    long, short = shape(131072), shape(4096)
    # long causal: everything is compute-bound and the ring hides its transfers
    ring_long = predict("ring", long, m)
    assert ring_long.exposed_comm_s < 0.05 * ring_long.total_s
    # short: the ring's per-step latency and small blocks cost relatively more than at 128K
    assert predict("ring", short, m).total_s / predict("ring", short, m).kernel_s > 1.0
    # more K/V heads -> more bytes for every strategy
    wide = CallShape(**{**base, "kv_heads": 32}, local_len=2048, ring_pairs=1, ring_rounds=1, total_pairs=2)
    narrow = CallShape(**base, local_len=2048, ring_pairs=1, ring_rounds=1, total_pairs=2)
    for strategy in ("ring", "allgather", "ulysses"):
        assert predict(strategy, wide, m).comm_s > predict(strategy, narrow, m).comm_s
    with pytest.raises(ValueError, match="unknown strategy"):
        predict("p2p", long, m)


def explain_report(local_len=4096):
    q = torch.empty(1, 32, local_len, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, local_len, 128, dtype=torch.bfloat16, device="meta")
    return dtcp.explain(q, k, k, layout="zigzag", is_causal=True)


def explain_reports():
    with dtcp.config.override(cost_objective="device"):
        device = explain_report(65536)
    with dtcp.config.override(layer_flops_per_token=1.3e9):  # ("auto": the step objective)
        step = explain_report(65536)
    return [explain_report(n) for n in (1024, 65536)] + [device, step]


def test_explain_is_the_same_on_every_rank():
    reports = run_ranks(2, explain_reports)
    assert reports[0] == reports[1]
    short, long, device, step = (r.splitlines() for r in reports[0])
    # the device objective says so, and predicts no more than the isolated call for any strategy
    assert device[-2] == "  (dtcp.config.cost_objective='device': the device's time alone, no host time counted)"
    call_times = {line.split()[0]: float(line.split()[2]) for line in long[1:-1]}
    device_times = {line.split()[0]: float(line.split()[2]) for line in device[1:-2]}
    assert set(device_times) == set(call_times) and all(device_times[s] <= call_times[s] for s in call_times)
    # the step objective too, and its times lie between the two (max(device, host - W) <= the call's)
    assert step[-2].startswith("  (cost objective 'step': each time is the call's share of a training step")
    assert step[-2].endswith("dtcp.config.layer_flops_per_token = 1.3e+09)"), step[-2]
    step_times = {line.split()[0]: float(line.split()[2]) for line in step[1:-2]}
    assert set(step_times) == set(call_times), step
    assert all(device_times[s] <= step_times[s] <= call_times[s] for s in call_times), (device_times, step_times)
    for lines in (short, long):
        assert lines[0].startswith("auto -> ")
        # meta tensors: the kernels a CUDA GPU of the shipped machine (compute capability 9.0) runs
        assert lines[-1].startswith("  (meta tensors: kernels as on a CUDA GPU of compute capability 9.0")
        lines = lines[:-1]
        assert {line.split()[0] for line in lines[1:]} == {"ring", "allgather", "ulysses"}
        assert all(" on fa4 x " in line for line in lines[1:]), lines
        times = [float(line.split()[2]) for line in lines[1:]]
        assert times == sorted(times)  # fastest first
    # 2 ranks x 1024 tokens x 8 heads x 128 x 2 (K, V) x 2 bytes = 8 MiB <= 16 MiB: the all-gather rule
    assert short[0].split()[2] == "allgather"
    # 128K tokens: the model's fastest
    assert long[0].split()[2] == long[1].split()[0] and "[short" not in long[0]


def calibrated():
    machine = dtcp.calibrate(dtype=torch.float32, heads=2, head_dim=16, seq_len=256, transfer_bytes=2**16, repeats=2)
    try:
        applied = dtcp.config.cost_machine is machine
        report = explain_report()
    finally:
        dtcp.config.cost_machine = None
    fields = {f: getattr(machine, f) for f in ("p2p_bytes_per_s", "collective_bytes_per_s", "latency_s",
                                              "kernel_flops_per_s", "kernel_half_rows", "call_overhead_s",
                                              "memory_bytes_per_s")}
    fields["fixed"] = tuple(sorted(dict(machine.fixed_s)))
    fields["kernels"] = tuple(name for name, _ in machine.kernel_rates)
    # (kernel, host seconds per launch) pairs: the shipped FA4 figure where no one-launch kernel runs here
    fields["launch_host"] = tuple(sorted(dict(machine.launch_host_s)))
    fields["fixed_positive"] = all(math.isfinite(t) and t >= 0 for _, t in machine.fixed_s)
    fields["rates_positive"] = all(math.isfinite(r) and r > 0 for _, r in machine.kernel_rates)
    return {"fields": fields, "applied": applied, "report": report}


def test_calibrate_measures_the_same_constants_on_every_rank():
    results = run_ranks(2, calibrated, timeout=300)
    assert results[0]["fields"] == results[1]["fields"]  # the slowest rank's figures, everywhere
    fields = dict(results[0]["fields"])
    assert fields.pop("fixed") == ("allgather", "ring", "ulysses") and fields.pop("kernels") == ("cpu_flash",)
    assert fields.pop("launch_host") == ("fa4",), results[0]
    assert fields.pop("fixed_positive") and fields.pop("rates_positive"), results[0]
    assert all(math.isfinite(v) and v > 0 for v in fields.values()), results[0]
    assert results[0]["applied"] and results[0]["report"] == results[1]["report"]


def ulysses_backward_twice():
    """retain_graph=True and a second backward: the kept head-sharded tensors are still there
    (gradients accumulate to exactly twice the first)."""
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 8, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, enable_gqa=True, strategy="ulysses")
    out.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in (q, k, v)]
    out.sum().backward()
    return max((t.grad - 2 * f).abs().max().item() for t, f in zip((q, k, v), first)), n


def test_ulysses_backward_twice_with_retain_graph():
    for err, _ in run_ranks(2, ulysses_backward_twice):
        assert err < 1e-12, err


# ---- documents: the local attention's keys are the rank's own, in order ---------------------------
def ulysses_documents_identity(docs, dtype_name, heads):
    """Ulysses over documents with a one-launch varlen kernel (the CPU varlen loop standing in for
    FA4): its local attention after the head exchange is one varlen call on one rank whose
    sequences take every key once, in order. Returns float64-style errors against the dense
    reference, whether that call packed its keys as the identity, and whether the identity's
    shortcut (views in, the kernel's dK/dV out) gives bitwise what the general path gives (K/V
    gathered by index, dK/dV summed in float32 by index)."""
    from dtcp.exec import allgather as ag
    from dtcp.exec import route as route_mod
    from dtcp.kernels.math import MathKernel
    from dtcp.comm import state_of
    from test_softcap_sinks import exact_err, window_doc_mask, dense_reference

    dtype = getattr(torch, dtype_name)
    route_mod.clear_routes()
    MathKernel.varlen_one_launch = True
    packing = ag._packing
    try:
        layout = dtcp.Zigzag()
        s, (hq, hkv) = sum(docs), heads
        cu = [0]
        for n in docs:
            cu.append(cu[-1] + n)
        g = torch.Generator().manual_seed(3)
        full = [torch.randn(1, h, s, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
        ref = [t.clone().requires_grad_() for t in full[:3]]
        out_ref, lse_ref = dense_reference(*ref, mask=window_doc_mask(s, is_causal=True, window=(-1, -1),
                                                                     cu_seqlens=cu), scale=0.3)
        out_ref.backward(full[3])
        results, identities = [], []
        for shortcut in (True, False):
            if not shortcut:
                ag._packing = lambda plan, device: dataclasses.replace(packing(plan, device), identity=False)
            local = [layout.shard(t, dim=2).to(dtype).detach().requires_grad_() for t in full[:3]]
            out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=True, scale=0.3, return_lse=True,
                                           enable_gqa=hq != hkv, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                           strategy="ulysses", backend="math")
            out.backward(layout.shard(full[3], dim=2).to(dtype))
            results.append((out, lse, *(t.grad for t in local)))
            route = next(iter(route_mod._routes_of(state_of(dist.group.WORLD)).values()))
            identities.append(isinstance(route.plan, ag.VarlenPlan) and ag._packing(route.plan, out.device).identity)
        want = (out_ref, lse_ref, *(t.grad for t in ref))
        errs = {key: exact_err(a.double(), layout.shard(b, dim=2)) for key, a, b in
                zip(("out", "lse", "dq", "dk", "dv"), results[0], want)}
        return {**errs, "identity": identities, "bitwise": all(torch.equal(a, b) for a, b in zip(*results))}
    finally:
        ag._packing = packing
        MathKernel.varlen_one_launch = False
        route_mod.clear_routes()


@pytest.mark.parametrize("world,docs,heads", [(2, (5, 11, 7, 9), (4, 2)), (4, (3, 29, 1, 15, 16), (8, 2))])
def test_ulysses_documents_take_the_keys_as_they_are(world, docs, heads):
    """float64 exact (1e-10) against the dense reference, and bitwise equal to the general
    all-gather varlen path in float64 and bfloat16 (4 ranks with 2 K/V heads: the K/V heads are
    replicated, and their dK/dV summed, after the call)."""
    for dtype_name in ("float64", "bfloat16"):
        for r in run_ranks(world, ulysses_documents_identity, docs, dtype_name, heads):
            assert r["identity"] == [True, False], r  # the shortcut taken, and (second run) not
            assert r["bitwise"], r
            if dtype_name == "float64":
                assert max(r[k] for k in ("out", "lse", "dq", "dk", "dv")) < 1e-10, r


# ---- the head exchange alone: an exact permutation -------------------------------------------------
EXCHANGE_CASES = [
    # (U, layout, batch, (Hq, Hkv), head dim): the pieces in order (contiguous), a few (zigzag), one
    # a token (striped), and Balanced's documents placed whole (dozens), with replicated K/V heads,
    # two batch rows and head dims whose token rows are not a power of two bytes
    (2, dtcp.Contiguous(), 1, (4, 2), 8),
    (2, dtcp.Zigzag(), 2, (4, 4), 12),
    (3, dtcp.Striped(1), 2, (6, 3), 5),
    (4, dtcp.Balanced((5, 30, 2, 9, 17, 1, 3, 11, 2, 8, 40)), 2, (8, 2), 12),
    (4, dtcp.Balanced((7,) * 4 + (100,)), 1, (8, 1), 6),
]


@pytest.mark.parametrize("u,layout,batch,heads,e", EXCHANGE_CASES)
def test_head_exchange_is_an_exact_permutation(u, layout, batch, heads, e):
    """to_heads gives each rank exactly its heads of the whole sequence in order, float32 lse rows
    travelling with bf16 ones in the same buffer; to_sequence gives back exactly the shards (K/V
    heads replicated over ranks come back summed: replicas x the shard)."""
    from sim_ranks import SimulatedRing, _AllToAll
    from dtcp.exec import ulysses as ul
    from dtcp.plan.ulysses import ulysses_plan

    hq, hkv = heads
    s = sum(layout.doc_lens) if isinstance(layout, dtcp.Balanced) else 12 * u
    local = s // u
    g = torch.Generator().manual_seed(u * 100 + hq)
    q_full = torch.randn(batch, hq, s, e, generator=g).to(torch.bfloat16)
    kv_full = torch.randn(batch, hkv, s, e, generator=g).to(torch.bfloat16)
    lse_full = torch.randn(batch, hq, s, 1, generator=g)
    perm = layout.permutation(s, u)  # rank-major position -> global token
    shards = [perm[r * local:(r + 1) * local] for r in range(u)]

    def rank_fn(rank, _comm):
        plan = ulysses_plan(layout, local, u, 1, rank, hq, hkv)
        own = shards[rank]
        # token-major q (a projection's (B, L, H, E) transposed) beside head-major K and lse
        q = q_full[:, :, own].transpose(1, 2).contiguous().transpose(1, 2)
        kv, lse = kv_full[:, :, own].contiguous(), lse_full[:, :, own].contiguous()
        q_h, k_h, lse_h = ul.to_heads([(q, plan.q), (kv, plan.kv), (lse, plan.q)], plan, rank)
        back = ul.to_sequence([(q_h, plan.q, q_h.dtype), (k_h, plan.kv, k_h.dtype), (lse_h, plan.q, lse_h.dtype)],
                              plan, rank, sum_dtype=torch.float32)
        return plan, (q, kv, lse), (q_h, k_h, lse_h), back

    saved = ul.all_to_all_bytes
    ul.all_to_all_bytes = _AllToAll(u)
    try:
        results = SimulatedRing(u).run(rank_fn)
    finally:
        ul.all_to_all_bytes = saved
    for rank, (plan, inputs, gathered, back) in enumerate(results):
        h, first = plan.q.per_rank, plan.q.first_head(rank)
        kv_first = plan.kv.first_head(rank)
        assert torch.equal(gathered[0], q_full[:, first:first + h]), rank
        assert torch.equal(gathered[1], kv_full[:, kv_first:kv_first + plan.kv.per_rank]), rank
        assert torch.equal(gathered[2], lse_full[:, first:first + h]), rank
        assert torch.equal(back[0], inputs[0]) and torch.equal(back[2], inputs[2]), rank
        assert back[0].is_contiguous() and back[1].is_contiguous(), rank
        assert torch.equal(back[1], (inputs[1].float() * plan.kv.replicas).to(torch.bfloat16)), rank


def test_exchange_layout_reads_as_token_rows_of_every_part():
    """Each part's offset and the row are multiples of the part's token row (and of 16 bytes)."""
    from dtcp.exec.ulysses import _layout, _row_bytes

    parts = [((2, 7, 3, 5), torch.bfloat16), ((2, 7, 1, 5), torch.float32), ((2, 7, 3, 1), torch.float32),
             ((2, 7, 2, 128), torch.bfloat16)]
    offsets, row = _layout(parts)
    for (shape, dtype), offset in zip(parts, offsets):
        rb = _row_bytes(shape, dtype)
        assert offset % rb == 0 and offset % 16 == 0 and row % rb == 0, (shape, dtype, offset, row)
    assert all(b >= a + math.prod(s) * d.itemsize for (a, (s, d)), b in zip(zip(offsets, parts), offsets[1:]))


def test_head_exchange_benchmark_smoke():
    """benchmarks/bench_head_exchange.py on the CPU, small: every layout's exchange runs (the
    all-to-all stood in), pieces counted, and the stand-in is put back."""
    import sys, os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_head_exchange
    from dtcp.exec import ulysses as ul

    saved = ul.all_to_all_bytes
    rows = bench_head_exchange.main(["--device", "cpu", "--lengths", "512", "--world-sizes", "2", "--reps", "1"])
    assert ul.all_to_all_bytes is saved
    assert [r["layout"] for r in rows] == ["contiguous", "zigzag", "lognormal", "documents"]
    assert all(r["pieces"] >= 2 and r["to_heads_qkv"] > 0 and r["to_sequence_grads"] > 0 for r in rows), rows
