"""The cost model behind strategy="auto" as it sees real batches: the slowest rank's work, the
launches each strategy makes, and the kernels CUDA would run for a prediction on meta tensors.

Pure arithmetic over the plans (dtcp.exec.route.call_shape and explain, the functions dtcp.explain
and auto use): no process group, no device, no timing."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import dtcp
from dtcp.exec import route
from dtcp.exec.fused import fused_steps
from dtcp.kernels import KERNELS, default_scale
from dtcp.plan import MACHINES, AttnMask, CallShape, plan_pairs, predict, ring_plans, segments_from_cu_seqlens

TOTAL = 131072  # tokens of the packed batch
MACHINE = MACHINES["h200-nvlink"]


def long_tailed(total: int, seed: int, alpha: float = 0.9, floor: int = 64) -> tuple[int, ...]:
    """A packed mix of Pareto lengths with a 64-token floor (a few long documents, many short
    ones), the last cut to fill `total`."""
    rng = random.Random(seed)
    docs = []
    while sum(docs) < total:
        docs.append(min(total, int(floor / rng.random() ** (1 / alpha))))
    docs[-1] -= sum(docs) - total
    return tuple(d for d in docs if d > 0)


def cu_of(docs) -> tuple[int, ...]:
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + d)
    return tuple(cu)


class _Group:  # a rank of a group, as route._problem reads it
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def meta_call(n: int, layout: str, docs=None, window=(-1, 0), heads=(32, 8), total=TOTAL):
    """(q, k, v, args, cu_values) of one causal call on n ranks, as meta tensors (bf16, D = 128)."""
    local = total // n
    q = torch.empty(1, heads[0], local, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, heads[1], local, 128, dtype=torch.bfloat16, device="meta")
    args = route.CallArgs("", layout, True, default_scale(128), "auto", window[0], window[1], "auto")
    return q, k, k, args, None if docs is None else cu_of(docs)


def shape_of(n, layout, docs=None, **kw) -> tuple[CallShape, list]:
    q, k, v, args, cu = meta_call(n, layout, docs, **kw)
    problem = route._problem(q, args, cu, _Group(n), None)
    return route.call_shape(q, k, v, args, problem)


def layout_of(name: str, docs):
    return dtcp.Balanced(docs) if name == "balanced" else dtcp.layouts.layout_from_spec(name)


@pytest.fixture(scope="module")
def docs():
    mix = long_tailed(TOTAL, seed=1)  # 125 documents, the longest 60270 tokens
    assert max(mix) > TOTAL // 4 and len(mix) > 20, (len(mix), max(mix))  # long-tailed indeed
    return mix


# ---- the model's inputs: the slowest rank, the launches -----------------------------------------------------
def test_ring_pairs_are_the_slowest_ranks(docs):
    """zigzag balances causal work over the sequence, not per document: on a long-tailed mix its
    busiest rank holds far more than 1/N of the pairs, and the model charges that rank. Balanced
    holds each rank within its tolerance of 1/N."""
    n = 4
    mask = AttnMask.make(True, (-1, 0), segments_from_cu_seqlens(cu_of(docs), TOTAL))
    for name in ("zigzag", "balanced"):
        shape, _ = shape_of(n, name, docs)
        per_rank = [plan_pairs(p.tasks) for p in ring_plans(layout_of(name, docs), TOTAL // n, n, True, mask)]
        assert shape.ring_pairs == max(per_rank) and shape.total_pairs == sum(per_rank)
        assert shape.allgather_pairs == max(per_rank)  # (the all-gather where allowed: the same rows)
    zig, _ = shape_of(n, "zigzag", docs)
    bal, _ = shape_of(n, "balanced", docs)
    assert zig.total_pairs == bal.total_pairs  # the same mask
    assert zig.ring_pairs > 1.5 * bal.ring_pairs, (zig.ring_pairs, bal.ring_pairs)  # 1.75x here
    assert bal.ring_pairs <= (1 + dtcp.layouts.balanced.TOLERANCE) * bal.total_pairs / n + 1
    assert zig.allgather_pairs == zig.ring_pairs  # the all-gather waits for the same rank


@pytest.mark.parametrize("name", ["zigzag", "balanced", "contiguous"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_launches_are_what_the_executors_run(docs, name, n):
    """Ring launches per pass are those of the rank that launches most, counted as exec/fused.py
    runs the plan with FA4 (one varlen launch per aligned window and step), or one per task with
    dtcp.config.ring_one_launch off; the all-gather's varlen plan and Ulysses are one launch."""
    mask = AttnMask.make(True, (-1, 0), segments_from_cu_seqlens(cu_of(docs), TOTAL))
    plans = ring_plans(layout_of(name, docs), TOTAL // n, n, True, mask)
    fa4 = KERNELS["fa4"]

    def executed(plan):
        steps = fused_steps(plan, fa4, torch.device("cpu"))
        return len(plan.tasks) if steps is None else sum(map(len, steps))

    shape, allowed = shape_of(n, name, docs)
    assert dict(shape.kernels)["ring"] == "fa4"
    assert shape.ring_calls == max(executed(p) for p in plans)
    assert shape.ring_calls < max(len(p.tasks) for p in plans) or max(len(p.tasks) for p in plans) <= 2
    assert shape.ulysses_calls == 1
    if "allgather" in allowed:
        assert shape.allgather_calls == 1
    with dtcp.config.override(ring_one_launch=False):
        unfused, _ = shape_of(n, name, docs)
    assert unfused.ring_calls == max(len(p.tasks) for p in plans)


def test_each_launch_costs_device_time():
    """The same work in more launches costs launch_s more per launch and pass (device time, not
    hidden), and the host's call overhead only where it is the larger."""
    base = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128, v_head_dim=128, elem_bytes=2, world_size=4,
                local_len=32768, ring_pairs=32768 ** 2, ring_rounds=3, ring_q_block=8192)
    one, many = (predict("ring", CallShape(**base, ring_calls=c), MACHINE) for c in (4, 104))
    assert many.kernel_s - one.kernel_s == pytest.approx(100 * 2 * MACHINE.launch_s, rel=1e-9)
    assert (one.launches, many.launches) == (4, 104)
    fwd = [predict("ring", CallShape(**base, ring_calls=c, backward=False), MACHINE) for c in (4, 104)]
    assert fwd[1].kernel_s - fwd[0].kernel_s == pytest.approx(100 * MACHINE.launch_s, rel=1e-9)


# ---- explain on meta tensors: the kernels CUDA would run ---------------------------------------------------
def test_meta_tensors_are_predicted_with_cuda_kernels():
    """A causal 128K call on 2 ranks: every strategy runs on FA4 (compute capability 9.0 of the
    shipped machine, FA4 counted as installed, nothing imported), and the predicted kernel time is
    within 2x of the call's flops at the machine's FA4 rate (the math kernel's would be ~15x)."""
    n = 2
    q, k, v, args, _ = meta_call(n, "zigzag")
    choice, preds = route.explain(q, k, v, args, None, n, 0)
    assert {p.kernel for p in preds} == {"fa4"}, preds
    flops = 2 * 32 * (TOTAL * (TOTAL + 1) / 2) * (128 + 128) * 3.5
    ideal = flops / n / MACHINE.rate_of("fa4")
    for p in preds:
        assert ideal <= p.kernel_s <= 2 * ideal, (p, ideal)
    assert choice in {p.strategy for p in preds}
    # a machine without FA4's compute capability: FA4 refuses, cuDNN-class rates instead
    ampere = dataclasses.replace(MACHINE, compute_capability=(8, 0))
    with dtcp.config.override(cost_machine=ampere):
        _, preds = route.explain(q, k, v, args, None, n, 0)
    assert "fa4" not in {p.kernel for p in preds} and "math" not in {p.kernel for p in preds}, preds
    # real (CPU) tensors keep their own device's kernels
    qc, kc = (torch.empty(t.shape, dtype=torch.float32) for t in (q[:, :, :64], k[:, :, :64]))
    _, preds = route.explain(qc, kc, kc, args, None, n, 0)
    assert {p.kernel for p in preds} <= {"cpu_flash", "math"}, preds


# ---- the ranking: Ulysses where the ring's layout is unbalanced ---------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_auto_takes_ulysses_over_an_unbalanced_ring(docs, n):
    """A long-tailed batch on zigzag: the ring (and the all-gather) wait for the busiest rank,
    Ulysses is balanced by construction, so auto takes Ulysses and the ring is far behind. On
    Balanced the ring does 1/N of the work per rank: its predicted time drops by a quarter or more
    (0.71x at N = 2 to 0.59x at N = 8 here). At N = 8 the two are a tie (within 1% here): Ulysses'
    all-to-alls against the ring's float32 merges and adds, which its fused launches cut by landing
    rows one later launch reaches straight in the results (exec/fused.py Landing; measured on one
    H100, Pareto s1 at N = 8, the ring's device time fell 12.1 -> 11.6 ms; Ulysses' compute is 7.7 ms,
    its transfers at N = 8 unmeasured: no 8-GPU machine)."""
    q, k, v, args, cu = meta_call(n, "zigzag", docs)
    choice, preds = route.explain(q, k, v, args, cu, n, 0)
    zigzag = {p.strategy: p.total_s for p in preds}
    assert choice == "ulysses" and preds[0].strategy == "ulysses", preds
    assert zigzag["ring"] > 1.3 * zigzag["ulysses"], zigzag  # 1.35x (N = 2) to 1.9x (N = 8) here
    q, k, v, args, _ = meta_call(n, "balanced", docs)
    choice, preds = route.explain(q, k, v, args, cu, n, 0)
    total = {p.strategy: p.total_s for p in preds}
    assert total["ring"] <= 0.75 * zigzag["ring"], (total, zigzag)
    if n == 8:
        assert abs(total["ring"] / total["ulysses"] - 1) < 0.02, total


def test_auto_keeps_the_ring_where_it_is_balanced():
    """Without documents zigzag is balanced: at 128K causal the ring's transfers hide behind its
    kernels and auto keeps it (or a strategy within 2% of it)."""
    for n in (2, 8):
        q, k, v, args, _ = meta_call(n, "zigzag")
        choice, preds = route.explain(q, k, v, args, None, n, 0)
        total = {p.strategy: p.total_s for p in preds}
        assert total["ring"] <= 1.02 * total[choice], total


def test_fa4_launches_are_host_bound_where_the_device_has_little_work():
    """FA4 launches go through Python (~0.5 ms a forward + backward pair, Machine.launch_host_s),
    and a ring launch adds its step's gathers, merge and dK/dV adds on the host
    (Machine.ring_launch_host_s): a ring whose rank runs many launches of little work is predicted
    at its host's time, not its flops'; a kernel without such a figure pays call_overhead_s per
    call instead of FA4's launch."""
    small = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128, v_head_dim=128, elem_bytes=2, world_size=16,
                 local_len=8192, ring_pairs=4e6, ring_rounds=15, ring_q_block=512, ring_calls=14,
                 kernels=(("ring", "fa4"),))
    host = MACHINE.host_of("fa4")
    step = MACHINE.ring_launch_host_s
    assert host == pytest.approx(dict(MACHINE.launch_host_s)["fa4"]) and step > 0
    fa4 = predict("ring", CallShape(**small), MACHINE)
    assert fa4.kernel_s == pytest.approx(14 * (host + step))  # the host's time, larger than the flops'
    other = predict("ring", CallShape(**{**small, "kernels": (("ring", "cudnn"),)}), MACHINE)
    assert MACHINE.host_of("cudnn") == pytest.approx(3 * MACHINE.call_overhead_s)
    assert other.kernel_s == pytest.approx(14 * (3 * MACHINE.call_overhead_s + step))
    # forward only: the forward's share of the pair
    fwd = predict("ring", CallShape(**small, backward=False), MACHINE)
    assert fwd.kernel_s == pytest.approx(14 * (host + step) * 0.4)
    # with much work per launch, the device's time wins again
    big = predict("ring", CallShape(**{**small, "ring_pairs": 2e9, "ring_q_block": 8192}), MACHINE)
    assert big.kernel_s > 14 * (host + step)
    # the all-gather's one launch each way pays FA4's launch, not a ring step's bookkeeping
    ag = predict("allgather", CallShape(**{**small, "allgather_pairs": 4e6, "allgather_calls": 1,
                                           "kernels": (("allgather", "fa4"),)}), MACHINE)
    assert ag.kernel_s < 2 * host


def test_calibrate_measures_a_launch_s_host_time():
    """dtcp.calibrate's launch_host_s: host seconds of one varlen launch's forward + backward,
    positive and finite (measured here with the CPU's math kernel, which loops over sequences)."""
    from dtcp.exec.calibrate import launch_host_s

    t = launch_host_s(KERNELS["math"], torch.device("cpu"), torch.float32, heads=2, head_dim=16, calls=3)
    assert 0 < t < 5.0


def test_fused_ring_pays_its_accumulators_memory_traffic(docs):
    """Fused ring steps merge into float32 accumulators over the rank's rows: call_shape counts
    the bytes (plan/fuse.py accumulator_traffic, the rank that moves most) and the model charges
    them at device memory speed on top of the kernels. Plain (task-by-task) plans count none."""
    from dtcp.plan.fuse import accumulator_traffic, fused_launches
    n = 4
    shape, _ = shape_of(n, "balanced", docs)
    mask = AttnMask.make(True, (-1, 0), segments_from_cu_seqlens(cu_of(docs), TOTAL))
    plans = ring_plans(dtcp.Balanced(docs), TOTAL // n, n, True, mask)
    fa4 = KERNELS["fa4"]
    steps = [fused_launches(p, fa4.reject_varlen_reason) for p in plans]
    # FA4 reads rows that lie apart in place (varlen gaps): no gather/scatter bytes for them
    want = max(accumulator_traffic(s, TOTAL // n, gaps=True) for s in steps)
    assert shape.ring_acc_bytes == want and want > 12 * (TOTAL // n)  # later steps merge some rows
    assert want < max(accumulator_traffic(s, TOTAL // n) for s in steps)  # some rows lie apart
    with dtcp.config.override(varlen_gaps=False):
        gathered, _ = shape_of(n, "balanced", docs)
    assert gathered.ring_acc_bytes == max(accumulator_traffic(s, TOTAL // n) for s in steps)
    plain = dataclasses.replace(shape, ring_acc_bytes=0)
    extra = predict("ring", shape, MACHINE).kernel_s - predict("ring", plain, MACHINE).kernel_s
    elems = shape.q_heads * (shape.head_dim + shape.v_head_dim)
    assert extra == pytest.approx(elems * want / MACHINE.memory_bytes_per_s)
    causal, _ = shape_of(n, "zigzag")  # plain causal zigzag: one task per step, not fused
    assert causal.ring_acc_bytes == 0


def test_accumulator_traffic_counts_fill_merges_and_gathers():
    """A step whose first launch covers every row writes the results itself. Later launches whose
    rows are in place land run by run (plan/fuse.py row_runs): 6 bytes an element where one launch
    reaches a row, 12 / 10 / 8 for the first / one between / the last of several. Where a launch's
    rows are scattered (gathered, no varlen gaps), the hull of the later rows goes through float32
    (6 bytes an element in, 6 back), each later launch merges its rows (10), 16 more where they are
    scattered. A pass of one launch moves nothing."""
    from dtcp.plan.fuse import Launch, accumulator_traffic
    local = Launch((-1, 0), ((0, 10),), ((0, 10),))
    tiled = Launch((-1, -1), ((2, 6),), ((0, 3),))
    scattered = Launch((-1, -1), ((0, 2), (7, 8)), ((0, 3), (5, 6)))
    # gathered rows: hull of the later rows [0, 8)
    assert accumulator_traffic(((local,), (tiled,), (scattered,)), 10) == 12 * 8 + 10 * 4 + 26 * 3
    # with gaps the scattered launch is in place: rows 0-1 and 7 once (6), 2-5 once (6)
    assert accumulator_traffic(((local,), (tiled,), (scattered,)), 10, gaps=True) == 6 * 3 + 6 * 4
    assert accumulator_traffic(((local,), (tiled,)), 10) == 6 * 4
    # rows 3-5 reached by both later launches: first 12, last 8; 2 and 6-7 once each
    other = Launch((-1, -1), ((3, 8),), ((0, 3),))
    assert accumulator_traffic(((local,), (tiled,), (other,)), 10) == 6 * 1 + 12 * 3 + 8 * 3 + 6 * 2
    assert accumulator_traffic(((local,), ()), 10) == 0
    # a first launch that leaves rows out: zeros (4) and a merge of its rows too
    partial = Launch((-1, 0), ((0, 8),), ((0, 8),))
    assert accumulator_traffic(((partial,), (tiled,)), 10) == 10 * 10 + 10 * 8 + 10 * 4


@pytest.mark.parametrize("name,masks,points,within_5", [
    ("strategies_2xh100_2026-11-26.json", ("causal",), 2, 2),
        # 4x H100 with the real transfers, the tip of 2026-11-27 (eighth session): Pareto s0, log-normal
    # s0 and long-tailed documents at 128K on Balanced; the ring within 1.8% of Ulysses on Pareto,
    # the fastest on the other two (Ulysses 1.6x and 1.3x slower with its all-to-alls)
    # (all three are placed otherwise since the twenty-third session: strategies_4xh100_2026-11-27c.json
    # is kept as the record, not replayed)
    # 2x H100 with the real transfers, the tip of 2026-11-27 (tenth session), on a fresh machine:
    # causal zigzag and the three Balanced mixes, all at 128K; the ring the fastest on the mixes
    # (Ulysses 1.1-2.3x slower), 3.7% behind Ulysses on causal
    ("strategies_2xh100_2026-11-27e.json", None, 1, 1),
    # The whole grid with the real transfers (twelfth session, ring step by step): every mask at 32K
    # and 128K, heads 32/8 and 32/32, on one 4x H100 machine at 4 ranks and then at 2. The misses
    # are all at 32K, where a call is host-bound: 4 ranks, 32/32 documents (zigzag and Balanced),
    # Ulysses 8% and 18% faster than the ring taken; 2 ranks, 32/8 causal (the all-gather taken,
    # 6.8% slower than the ring), documents and Pareto (the ring taken, 14% and 7% slower than the
    # all-gather).
    # (Since the thirtieth session Balanced fills its last rooms along the ring: two more of the
    # 4-rank Balanced points are placed otherwise, 12 kept, of which 11 within 5%; the miss: the ring
    # on 32/32 documents at 32K.)
    ("strategies_4xh100_2026-11-27g.json", None, 12, 11),
    ("strategies_2xh100_2026-11-27g.json", None, 14, 12),
    # The 32K half again on a second 4x H100 machine: the same code's wall times moved by up to 21%
    # (the ring on Pareto 32/8: 9.26 -> 11.24 ms), and auto was within 5% at 7 of 12 (10 of 12 above)
    # (6 kept since the thirtieth session, 4 within 5%)
    ("strategies_4xh100_2026-11-27h.json", None, 6, 4),
    # 4x and 2x H200 (sixteenth session, two machines; causal and the three document mixes at 32K
    # and 128K, 32/8 heads): machine 1's calibration put the ring's fixed host cost at 0.87 ms (3.61
    # on machine 2) and at 32K auto took the ring over the three document mixes, at 1.6-2.1x the
    # all-gather's time; every other point within 5%
    # (the 4-rank runs' log-normal 32K point is placed otherwise since the thirtieth session: 2 kept,
    # both within 5%)
    ("strategies_4xh200_2026-11-28.json", None, 2, 2),
    ("strategies_2xh200_2026-11-28.json", None, 3, 3),
    ("strategies_4xh200_2026-11-28b.json", None, 2, 2),
    ("strategies_2xh200_2026-11-28b.json", None, 3, 3),
    # 2x H200 (twenty-eighth session, 44d2b5b; causal and the three document mixes at 32K and 128K,
    # 32/8 heads): the ring taken at every point; at 32K on Pareto the all-gather was 6.4% faster
    ("strategies_2xh200_2026-11-29.json", None, 8, 7),
    # 4x H200 (twenty-ninth session, 6029af7, calibrated from calls back to back; the same grid):
    # every pick within 5% (the Pareto and log-normal points at 32K are placed otherwise since the
    # thirtieth session: 6 kept)
    ("strategies_4xh200_2026-11-29.json", None, 6, 6),
    # ... and on a second machine (2a155e0), the three document mixes at 32K with the all-gather
    # moving only the keys other ranks read, then whole shards (DTCP_ALLGATHER_EXCHANGE=0), each
    # replayed as it ran: on "long-tailed documents" the ring (2.48 ms) beat the exchanging
    # all-gather auto took (2.85 ms), whose model came within 0.9 ms where the ring's stayed 1.6 ms over
    # (only that point is still placed as measured since the thirtieth session)
    ("strategies_4xh200_2026-11-29_exchange_on.json", None, 1, 0),
    ("strategies_4xh200_2026-11-29_exchange_off.json", None, 1, 1),
])
def test_measured_multi_gpu_runs_replayed(name, masks, points, within_5):
    """benchmarks/bench_strategies.py's replay (this checkout's model on a measured run's shapes)
    on measured runs with the real transfers (2x and 4x H100 and H200, FA4, 2026-11-26 to 29), for the
    points whose layout this checkout still places as it was measured (bench_strategies'
    `placed_as_measured`: since the twenty-third session most Balanced points are placed
    otherwise, and runs "c" and "d" of the 2x H100, packed documents on Balanced at 32K, 64K and
    128K, where auto was within 5% of the best at 7 and 6 of 9 points, are kept as the record). The misses are at 32K, where an all-gather is 1.1-1.2x faster
    than the ring and the model has them within 0.5 ms, less than the calibration moves between
    two runs on one machine (its fixed host cost of a ring call: 3.15 ms, then 2.58 ms). Of the
    first run only the causal (zigzag) points count: its Balanced points, and all of run "b", were
    measured with Balanced's previous local order (every run in global order), whose plans this
    checkout no longer builds (the JSONs stay as the record)."""
    import os
    bench_strategies, bench = _benchmark("bench_strategies")
    rows = [row for row in bench_strategies.replay(os.path.join(bench, "results", name))
            if (masks is None or row["mask"] in masks) and row["placed_as_measured"]]
    assert len(rows) == points
    within = [row["measured"][row["pick"]] <= 1.05 * min(row["measured"].values()) for row in rows]
    assert sum(within) >= within_5, [(r["S"], r["mask"], r["pick"], r["measured"]) for r in rows]


@pytest.mark.parametrize("name,points,left_out,within_5,kernel_within_5", [
    # (Since the twenty-third session Balanced fills the last rooms with whole short documents,
    # breaks ties on the host's time by the device's and tries narrower windows: most log-normal
    # points and some Pareto ones are placed otherwise, so their measured times are left out below;
    # on the points still placed as measured the picks are the same as before.)
    # (since the ring's first launch writes the results directly (2026-11-27) the model charges
    # float32 accumulators only over the rows later launches touch, none for a pass of one launch:
    # on grid a's 16 x 8K documents its kernel part now ranks the ring first at N = 2, 4, 8 (zigzag
    # and Balanced, 6 points), where the measured ring is the fastest or within 5% at 4 and 6-8%
    # slower at 2 (N = 2 Balanced, N = 8 zigzag): 31 -> 29. The grids measured on this code follow.)
    ("split_h100_2026-11-26_documents_grid_a.json.gz", 28, 8, 23, 25),
    ("split_h100_2026-11-26_documents_grid_b.json.gz", 16, 8, 14, 16),
    # Balanced with windows and steps weighed (the four long-tailed mixes; ring, all-gather, Ulysses;
    # Pareto s1 at N = 8 is placed otherwise since: the window search stops at the first width
    # that does not help)
    # (two more points placed otherwise since the thirtieth session's fill along the ring)
    ("split_h100_2026-11-26_balanced_steps.json.gz", 1, 15, 1, 1),
    # the same grid on the final code
    ("split_h100_2026-11-26_balanced_final_windows.json.gz", 1, 15, 1, 1),
    # the first launch writing the results directly (2026-11-27): Pareto s0/s1 and causal 32K;
    # log-normal s0/s1 (zigzag and Balanced; ring, all-gather, Ulysses)
    # (grids a: one more point placed otherwise since the thirtieth session; grids b: one too)
    ("split_h100_2026-11-27_direct_a.json.gz", 13, 7, 11, 13),
    ("split_h100_2026-11-27_direct_b.json.gz", 8, 8, 5, 8),
    # the same two grids on this code (the grouped ring's helpers shared with the ring's steps),
    # 2026-11-27 (eighth session): the same device times; auto's misses are the ring taken over a
    # Ulysses whose compute is faster at N = 2-8; at N = 4 on 4x H100 with the real all-to-alls
    # the ring was the faster (benchmarks/results/strategies_4xh100_2026-11-27_direct.json, _27c)
    ("split_h100_2026-11-27_final_a.json.gz", 13, 7, 10, 13),
    ("split_h100_2026-11-27_final_b.json.gz", 8, 8, 5, 8),
    # the same grids again on a second H100 machine (the run-to-run spread)
    ("split_h100_2026-11-27_final2_a.json.gz", 13, 7, 11, 13),
    ("split_h100_2026-11-27_final2_b.json.gz", 8, 8, 5, 8),
    # and the rest of the cases on the same code: causal 128K, window (4096, 0), 16 x 8K
    # documents (zigzag and Balanced); misses: the ring over Ulysses at N = 8-16, and at N = 4-16
    # on the window
    ("split_h100_2026-11-27_final_c.json.gz", 16, 0, 11, 15),
    # grids a and b with the ring's later launches landing rows run by run (ninth session,
    # 5dd6d18; accumulator_traffic counts the roles' bytes): the same kind of misses, all the
    # ring taken over a Ulysses whose compute is faster, at N = 2-8
    ("split_h100_2026-11-27_landing_a.json.gz", 13, 7, 11, 13),
    ("split_h100_2026-11-27_landing_b.json.gz", 8, 8, 5, 8),
    # the grid on one H200 per slice (sixteenth session, the fifteenth's code; 200 s a slice,
    # so the s1 mixes and N = 16 of the s0 mixes were not reached): causal 32K, window, 16 x 8K;
    # causal 128K; Pareto s0; log-normal s0. The misses: the ring over a Ulysses whose compute is
    # faster (its all-to-alls, which the model charges, are not run on one GPU)
    ("split_h200_2026-11-28_grid_0.json.gz", 20, 0, 14, 19),
    ("split_h200_2026-11-28_grid_1.json.gz", 4, 0, 2, 4),
    ("split_h200_2026-11-28_grid_2.json.gz", 6, 3, 6, 6),
    ("split_h200_2026-11-28_grid_3.json.gz", 6, 2, 4, 6),
    # and the s1 mixes on a fifth machine (ring, all-gather, Ulysses; zigzag and Balanced; N = 2, 4 | 8)
    ("split_h200_2026-11-28_s1_0.json.gz", 2, 2, 1, 2),
    ("split_h200_2026-11-28_s1_1.json.gz", 1, 1, 1, 1),
    ("split_h200_2026-11-28_s1_2.json.gz", 2, 2, 1, 2),
    ("split_h200_2026-11-28_s1_3.json.gz", 1, 1, 1, 1),
])
def test_measured_one_gpu_document_grid_replayed(name, points, left_out, within_5, kernel_within_5):
    """benchmarks/bench_split.py's replay (this checkout's model, on meta tensors) of the packed-
    document grid measured on one H100 (2026-11-26, FA4; 16 x 8K, two Pareto and two log-normal
    mixes; zigzag, DocZigzag and Balanced; N = 2, 4, 8, 16; heads 32/8). Balanced now places 6 of
    the 60 points' documents otherwise (windows, at N = 8 and 16), so their times are left out:
    auto's pick is within 5% of the best measured compute at 44 of 54 points, the model's kernel
    part alone at 49 of 54. The benchmark measures compute only; auto adds modeled communication,
    and every miss of the full pick is the ring chosen over a Ulysses whose compute is faster and
    whose all-to-alls the model charges (one GPU cannot check those)."""
    import os
    bench_split, bench = _benchmark()
    summary = bench_split.replay(os.path.join(bench, "results", name))["auto_summary"]
    assert summary["points"] == points and summary["left_out_placed_otherwise"] == left_out, summary
    assert summary["within_5pct"] >= within_5, summary
    assert summary["kernel_model_within_5pct"] >= kernel_within_5, summary


def test_one_build_chooses_the_rings_steps_once(docs, monkeypatch):
    """With strategy="auto" and ring_steps_per_launch="auto" a route build chooses the ring's steps
    per launch once: the cost model's choice (for its ranking) is the one the ring's route takes
    (_Problem.ring_choices, which lives for one build: a new document structure every batch is a
    new build). Another build, other plans or another kernel choose anew. (On CPU "auto" takes the
    exchange policy, not the cost model: here it takes the model, on the meta device's kernels.)"""
    calls = []
    choose = route._ring_choice_of
    monkeypatch.setattr(route, "_ring_choice_of", lambda *a: calls.append(a[1].name) or choose(*a))
    monkeypatch.setattr(route, "strategy_candidates", lambda req, q, k, v, args, problem:
                        ("ring",) + tuple(s for s in route.auto_order(q, k, v, args, problem)[0] if s != "ring"))
    monkeypatch.setattr(route, "predicted_target", lambda q, machine: None)
    with dtcp.config.override(ring_steps_per_launch="auto"):
        q, k, v, args, cu = meta_call(8, "balanced", docs)
        built = route._build(q, k, v, args, cu, _Group(8), None, False)
        assert built[0] == "ring" and len(calls) == 1, (built, calls)
        route._build(q, k, v, args, cu, _Group(8), None, False)  # a new build
        assert len(calls) == 2, calls
        problem = route._problem(q, args, cu, _Group(8), None)
        plans, kernel = route._plans_and_kernel("ring", problem.layout, q, k, v, args, problem.row_segments, 8, False)
        memo = {}
        first = route._ring_choice(plans, kernel, q, k, v, 8, memo)
        assert route._ring_choice(plans, kernel, q, k, v, 8, memo) is first and len(calls) == 3
        route._ring_choice(plans, KERNELS["fa4"], q, k, v, 8, memo)  # another kernel
        route._ring_choice([dataclasses.replace(p) for p in plans], kernel, q, k, v, 8, memo)  # equal, not the same
        assert len(calls) == 5 and calls[-2:] == ["fa4", kernel.name], calls


def _benchmark(name: str = "bench_split"):
    """benchmarks/<name>.py as a module, and the benchmarks folder (its results)."""
    import importlib
    import os
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module(name), bench
    finally:
        sys.path.remove(bench)


def _auto_ring_size(B, case, layout: str, n: int) -> tuple[int, int]:
    """(ring_steps_per_launch="auto"'s size, the plan's rounds) for bench_split's `case` (32/8
    heads, D = 128, 1 row) over n ranks, as an H100 with FA4 would take it (meta tensors)."""
    from dtcp.exec import route as R
    from dtcp.kernels import Target
    point = B.make_point(case, layout, 32, 8, 128, n, "auto")
    q = torch.empty(1, 32, point.local_len, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 8, point.local_len, 128, device="meta", dtype=torch.bfloat16)
    problem = R._problem(q, point.args, point.cu_values, B._Group(n, 0), None)
    plans, kernel = R._plans_and_kernel("ring", problem.layout, q, k, k, point.args, problem.row_segments, n,
                                        False, Target("cuda", (9, 0)))
    assert kernel.name == "fa4"
    with dtcp.config.override(ring_steps_per_launch="auto"):
        return R.ring_steps(plans, kernel, q, k, k, n), plans[0].num_rounds


def test_auto_steps_per_launch_against_one_h100():
    """dtcp.config.ring_steps_per_launch = "auto" (exec/route.py ring_steps) on the points
    measured on one H100 at G = 1, 4 and one group of every round (bench_split, FA4, 32/8 heads,
    benchmarks/results/split_h100_2026-11-27_groups.json): its size is within 5% of the fastest
    measured at 7 of the 9 points (G = 1 everywhere: 5 of 9). The two misses are at N = 16: causal
    32K takes one group where a group of 4 measured 14% faster (and step by step 2x slower), and the
    log-normal mix takes one group where step by step measured 11% faster (its slowest rank holds
    pieces of one long document: imbalance 1.86, which groups do not help)."""
    import json
    import os
    B, bench = _benchmark()
    with open(os.path.join(bench, "results", "split_h100_2026-11-27_groups.json")) as f:
        points = json.load(f)["points"]
    measured: dict = {}
    for p in points:
        measured.setdefault((p["case"], p["layout"], p["world_size"]), {})[p["steps_per_launch_setting"]] = p["slowest_ms"]
    cases = {c.name: c for c in B.build_cases(1.0)}
    within, g1_within, picks = 0, 0, {}
    for (case, layout, n), ms in sorted(measured.items()):
        size, rounds = _auto_ring_size(B, cases[case], layout, n)
        measured_as = 1 if size == 1 else (16 if size == rounds else 4)
        assert size in (1, min(4, rounds), rounds), size
        best = min(ms.values())
        within += ms[measured_as] <= 1.05 * best
        g1_within += ms[1] <= 1.05 * best
        picks[(case, n)] = size
    assert (within, g1_within) == (7, 5), picks
    assert picks[("causal-32k", 4)] == picks[("pareto-s0", 4)] == 1  # gains under GROUP_GAIN at N = 4


def test_auto_steps_per_launch_against_one_h100_after_the_landing_fix():
    """The ring at G = 1 and at "auto"'s size, measured on one H100 in one run after the grouped
    ring stopped waiting for the device at its group launches (bench_split, FA4, 32/8 heads,
    Balanced long-tailed mixes and causal 32K zigzag, N = 4, 8, 16:
    benchmarks/results/split_h100_2026-11-27k_G1/_Gauto.json.gz). This checkout's "auto" takes
    the size measured at all 15 points; it is within 5% of the faster of the two at 14 (G = 1
    everywhere: 8). It groups at 9 points: faster at 7 (causal 32K N = 16 13.37 -> 7.83 ms), slower
    at Pareto s1 N = 8 (+3.9%) and log-normal s1 N = 16 (+6.4%, the miss). Since the twenty-third
    session 9 of the 12 Balanced points are placed otherwise (left out), and since the thirtieth
    (the last rooms filled along the ring) 11; on the 4 left, auto is within 5% at 4 (G = 1
    everywhere: 1) and groups at 3, faster at 3."""
    import gzip
    import json
    import os
    B, bench = _benchmark()
    measured: dict = {}
    for setting in ("G1", "Gauto"):
        with gzip.open(os.path.join(bench, "results", f"split_h100_2026-11-27k_{setting}.json.gz"), "rt") as f:
            for p in json.load(f)["points"]:
                measured.setdefault((p["case"], p["layout"], p["world_size"]), {})[setting] = \
                    (p["steps_per_launch"], p["slowest_ms"], p["work_per_rank"])
    assert len(measured) == 15
    cases = {c.name: c for c in B.build_cases(1.0)}
    within = g1_within = grouped = faster = kept = 0
    for (case, layout, n), got in sorted(measured.items()):
        point = B.make_point(cases[case], layout, 32, 8, 128, n, "auto")
        if not B.placed_as_measured(point, got["G1"][2], torch.bfloat16):
            continue  # placed otherwise since (the twenty-third session's refill and tie-break)
        kept += 1
        size, _ = _auto_ring_size(B, cases[case], layout, n)
        (g1_size, g1_ms, _), (auto_size, auto_ms, _) = got["G1"], got["Gauto"]
        assert g1_size == 1 and size == auto_size, (case, n, size, auto_size)
        best = min(g1_ms, auto_ms)
        within += auto_ms <= 1.05 * best
        g1_within += g1_ms <= 1.05 * best
        grouped += size > 1
        faster += size > 1 and auto_ms < g1_ms
    assert (kept, within, g1_within, grouped, faster) == (4, 4, 1, 3, 3)


def test_explain_shows_the_rings_steps_per_launch():
    """With ring_steps_per_launch="auto", the ring's prediction is the pass at the size the route
    would take (ring_steps), and says it: causal 32K over 16 ranks (where one H100 measured groups
    1.7-2x faster) groups every received block, with fewer launches than step by step; with the
    setting at 1 the ring runs step by step and says nothing."""
    q, k, v, args, _ = meta_call(16, "zigzag", total=32768)
    problem = route._problem(q, args, None, _Group(16), None)
    step_by_step = next(p for p in route.explain(q, k, v, args, None, 16, 0)[1] if p.strategy == "ring")
    assert step_by_step.note == "" and step_by_step.launches == 16, step_by_step
    with dtcp.config.override(ring_steps_per_launch="auto"):
        ring = next(p for p in route.explain(q, k, v, args, None, 16, 0)[1] if p.strategy == "ring")
        plans, kernel = route._plans_and_kernel("ring", problem.layout, q, k, v, args, problem.row_segments, 16,
                                                False, route.predicted_target(q, MACHINE))
        size = route.ring_steps(plans, kernel, q, k, v, 16)
    assert size == 15 and ring.note.startswith("15 received blocks a launch"), (size, ring)
    assert ring.launches < step_by_step.launches and ring.total_s < step_by_step.total_s, (ring, step_by_step)


# ---- the cost objective: an isolated call's time, or the device's alone -------------------------------------
def test_device_objective_is_the_call_without_its_host_time():
    """cost_objective="device" predicts every strategy as a machine whose host costs nothing
    would under "call" (no launch host time, no fixed host cost per call), and never above
    "call"; on a packed batch at 32K over 4 ranks the ring (many FA4 launches) is host-bound, so
    its "call" prediction exceeds its device one by at least its fixed cost."""
    machine = dataclasses.replace(MACHINE, fixed_s=(("ring", 3e-3), ("allgather", 2e-3), ("ulysses", 4e-3)))
    host_free = dataclasses.replace(machine, fixed_s=(), launch_host_s=(), call_overhead_s=0.0, ring_launch_host_s=0.0)
    batch = long_tailed(32768, seed=2)
    q, k, v, args, cu = meta_call(4, dtcp.Balanced(batch).op_spec(), batch, total=32768)

    def totals(objective, constants):
        with dtcp.config.override(cost_objective=objective, cost_machine=constants):
            return {p.strategy: p.total_s for p in route.explain(q, k, v, args, cu, 4, 0)[1]}

    call, device, free = totals("call", machine), totals("device", machine), totals("call", host_free)
    assert set(call) == {"ring", "allgather", "ulysses"}, call
    assert device == pytest.approx(free, rel=1e-12), (device, free)
    assert all(device[s] <= call[s] for s in call), (device, call)
    assert call["ring"] - device["ring"] >= 3e-3, (call, device)


def test_cost_objective_setting():
    with pytest.raises(ValueError, match="cost_objective must be one of"):
        dtcp.config.cost_objective = "wall"
    assert dtcp.config.cost_objective == "auto" and dtcp.config.layer_flops_per_token is None
    assert dtcp.config.cost_objective_in_force() == "call"  # ("auto" without a layer's FLOPs)
    with dtcp.config.override(layer_flops_per_token=1.3e9):
        assert dtcp.config.cost_objective_in_force() == "step"
        with dtcp.config.override(cost_objective="call"):  # an explicit objective stands
            assert dtcp.config.cost_objective_in_force() == "call"
    with dtcp.config.override(cost_objective="step"):
        with pytest.raises(ValueError, match="layer_flops_per_token"):
            dtcp.config.cost_objective_in_force()
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1e9"):
        with pytest.raises(ValueError, match="layer_flops_per_token must be a positive number"):
            dtcp.config.layer_flops_per_token = bad
    assert dtcp.config.layer_flops_per_token is None


# ---- the step objective: the call inside a training step ---------------------------------------------
def _step_totals(machine, flops, q, k, v, args, cu, n):
    with dtcp.config.override(cost_machine=machine, cost_objective="step", layer_flops_per_token=flops):
        return {p.strategy: p for p in route.explain(q, k, v, args, cu, n, 0)[1]}


def test_step_objective_between_call_and_device():
    """Under "step" each strategy costs max(device, host - W), W the rest of the layer's device
    time (layer_flops_per_token x local tokens / matmul rate): with no work around it, the larger
    of its device and host times (host = its launches' and its fixed cost); with more work than
    any host time, the "device" objective's time exactly; never below "device" and falling as W
    grows. On a packed batch at 32K over 4 ranks the ring is host-bound: "step" ranks it by its
    host time until the layer covers it."""
    machine = dataclasses.replace(MACHINE, fixed_s=(("ring", 3e-3), ("allgather", 2e-3), ("ulysses", 4e-3)))
    batch = long_tailed(32768, seed=2)
    q, k, v, args, cu = meta_call(4, dtcp.Balanced(batch).op_spec(), batch, total=32768)
    with dtcp.config.override(cost_machine=machine, cost_objective="device"):
        device = {p.strategy: p.total_s for p in route.explain(q, k, v, args, cu, 4, 0)[1]}
    tokens = q.shape[0] * q.shape[2]
    totals = []
    for flops in (1e-3, 1e8, 1e9, 1e10, 1e13):
        step = _step_totals(machine, flops, q, k, v, args, cu, 4)
        w = flops * tokens / machine.matmul_flops_per_s
        assert set(step) == set(device), (step, device)
        for s, p in step.items():
            assert p.total_s >= device[s] * (1 - 1e-12) and "in a step" in p.note, (s, p)
            assert p.other_s == pytest.approx(w, rel=1e-12), (s, p, w)
            assert p.total_s == pytest.approx(max(device[s], p.host_s - w), rel=1e-12), (s, p, w)
            assert p.host_s >= dict(machine.fixed_s)[s], (s, p)  # (its launches' host time and its fixed cost)
        totals.append(step)
    assert totals[0]["ring"].total_s > device["ring"] + 3e-3, (totals[0]["ring"], device)  # host-bound
    for s in device:  # more work around the call: never dearer, and at last the device's time
        seq = [t[s].total_s for t in totals]
        assert all(a >= b for a, b in zip(seq, seq[1:])), (s, seq)
        assert seq[-1] == pytest.approx(device[s], rel=1e-12), (s, seq, device)


def test_step_objective_forward_only_counts_the_forward_share():
    """A forward-only call (backward=False) has a third of the layer's forward + backward work
    around it."""
    machine = dataclasses.replace(MACHINE, fixed_s=(("ring", 3e-3),))
    q, k, v, args, _ = meta_call(4, "zigzag", total=32768)
    for backward, share in ((True, 1.0), (False, 1 / 3)):
        with dtcp.config.override(cost_machine=machine, cost_objective="step", layer_flops_per_token=1e9):
            p = next(p for p in route.explain(q, k, v, args, None, 4, 0, backward=backward)[1] if p.strategy == "ring")
        assert p.other_s == pytest.approx(1e9 * q.shape[2] * share / machine.matmul_flops_per_s, rel=1e-12), p


def test_cost_objective_from_the_environment(monkeypatch):
    from dtcp.config import Config

    monkeypatch.setenv("DTCP_COST_OBJECTIVE", " Device ")
    assert Config.from_env().cost_objective == "device"
    monkeypatch.setenv("DTCP_COST_OBJECTIVE", "host")
    with pytest.raises(ValueError, match="cost_objective"):
        Config.from_env()


@pytest.mark.parametrize("name,objective,times,kept,within_5", [
    # 4x H100 (4 ranks), every mask at 32K, 32/8 and 32/32 heads, each call timed alone (wall) and
    # with its host hidden (device; bench_strategies --host-hidden). With its host hidden the ring is
    # the fastest at 8 of 10 points (1.1-3.8x below the next fastest on the packed mixes), but its host
    # takes 6.4-11.2 ms to queue 1.3-4.8 ms of device work, so alone it is the slowest there. On all
    # 10, each objective got its own time right at 8 and the other's at 3; on the 6 this checkout
    # still places as measured (docs-balanced and Pareto are placed otherwise since the twenty-third
    # session), at 4 and 3 ("call") and 5 and 2 ("device"); on the 4 still placed as measured
    # since the thirtieth session (log-normal too is placed otherwise), at 3 and 2, and 3 and 2.
    ("strategies_4xh100_2026-11-27i_hidden_32k.json", "call", "measured", 4, 3),
    ("strategies_4xh100_2026-11-27i_hidden_32k.json", "call", "device", 4, 2),
    ("strategies_4xh100_2026-11-27i_hidden_32k.json", "device", "device", 4, 3),
    ("strategies_4xh100_2026-11-27i_hidden_32k.json", "device", "measured", 4, 2),
    # at 128K the device's work dwarfs every host: both objectives picked within 5% at 10 of 10
    # (every Balanced mask is placed otherwise now: the 4 causal and zigzag-document points are kept)
    ("strategies_4xh100_2026-11-27i_hidden_128k.json", "call", "measured", 4, 4),
    ("strategies_4xh100_2026-11-27i_hidden_128k.json", "device", "device", 4, 4),
    # 2 ranks at 32K: two steps, less host; the ring the fastest with its host hidden at 10 of 10
    # (9 and 10 within 5% on all 10; the long-tailed mixes are placed otherwise now: 6 of 6 kept)
    ("strategies_2xh100_2026-11-27i_hidden_32k.json", "call", "measured", 6, 6),
    ("strategies_2xh100_2026-11-27i_hidden_32k.json", "device", "device", 6, 6),
])
def test_measured_runs_with_the_host_hidden_replayed(name, objective, times, kept, within_5):
    """bench_strategies' replay of the runs that timed each call alone and with its host hidden
    (10 points each): auto within 5% of the best under each objective, against the time it ranks
    for and against the other one, on the points this checkout still places as measured."""
    import os
    bench_strategies, bench = _benchmark("bench_strategies")
    with dtcp.config.override(cost_objective=objective):
        rows = bench_strategies.replay(os.path.join(bench, "results", name))
    assert len(rows) == 10 and all(row[times] for row in rows)
    rows = [row for row in rows if row["placed_as_measured"]]
    assert len(rows) == kept
    within = [row[times][row["pick"]] <= 1.05 * min(row[times].values()) for row in rows]
    assert sum(within) == within_5, [(r["S"], r["heads"], r["mask"], r["pick"], r[times]) for r in rows]


@pytest.mark.parametrize("name,kept,call_within_5,device_within_5,step_within_5", [
    # (Each run timed three Balanced batches at 32K. Since the twenty-third session this checkout
    # places two of the three otherwise at each run's N (docs-balanced and Pareto at 4 ranks, the
    # long-tailed mixes at 2), and since the thirtieth (the last rooms filled along the ring) the
    # third at 4 ranks too, the log-normal batch whose 33-token document lay on all four: of the
    # 4-rank runs (train_step_4xh100_2026-11-27{,b,c}_dim{4096,2048}.json, kept as the record) no
    # batch is judged. Their own figures, on all three batches: at dim 4096 (4 layers of an 8B-class
    # model, 32/8 heads, 32K packed tokens over 4 H100s) the layers' matmuls hide the ring's host and
    # the ring is the fastest step on all three (0.8-8.3% ahead of the next), which "device" and
    # "step" pick and "call" does not (it takes the all-gather); at dim 2048 (16/8 heads) too little
    # matmul work hides the ring's host, the all-gather or Ulysses is the fastest, "call" within 1.5%
    # on all three, "device" 8.5% slower on one; "step" missed once by 8.6% (log-normal, dim 2048).)
    # the same layers on 2 H100s (16K tokens a rank; the script as landed): the ring the fastest step
    # at all six points (6.0-12.5% ahead of the next), and both objectives take it
    ("train_step_2xh100_2026-11-27_dim4096.json", 1, 1, 1, 1),
    ("train_step_2xh100_2026-11-27_dim2048.json", 1, 1, 1, 1),
])
def test_measured_training_steps_replayed(name, kept, call_within_5, device_within_5, step_within_5):
    """benchmarks/bench_train_step.py's replay: the strategy auto picks under each objective,
    against the measured step times of a stack of decoder layers. "step" (the layers' own FLOPs
    per token; the shipped matmul rate for the runs that predate its calibration) was within 5% of
    the fastest step at 20 of 21 points, "call" at 17 (it misses at dim 4096, up to 8.6% slower),
    "device" at 19 (it misses at dim 2048, up to 8.6%); on the 2 rows this checkout still places
    as measured (the 2-rank runs), at 2, 2 and 2."""
    import os
    bench_train_step, bench = _benchmark("bench_train_step")
    rows = [r for r in bench_train_step.replay(os.path.join(bench, "results", name)) if r["placed_as_measured"]]
    assert len(rows) == kept

    def within(objective):
        return sum(r["step_s"][r["picks"][objective]] <= 1.05 * min(r["step_s"].values()) for r in rows)

    assert (within("call"), within("device"), within("step")) == (call_within_5, device_within_5, step_within_5), rows


@pytest.mark.parametrize("rate,within_5", [(400e12, 2), (900e12, 2)])
def test_measured_training_steps_replayed_at_other_matmul_rates(rate, within_5):
    """The step objective's picks do not hang on the matmul rate: at 400 and 900 TFLOP/s (the
    shipped 650 +- 40%) within 5% of the fastest step at 20 and 21 of the 21 points (2 of the 2
    this checkout still places as measured since the thirtieth session)."""
    import glob
    import os
    bench_train_step, bench = _benchmark("bench_train_step")
    bench_strategies, _ = _benchmark("bench_strategies")
    within = total = 0
    for name in sorted(glob.glob(os.path.join(bench, "results", "train_step_*.json"))):
        with open(name) as f:
            machine = bench_strategies.machine_of(json.load(f))
        rows = [r for r in bench_train_step.replay(name, machine=dataclasses.replace(machine, matmul_flops_per_s=rate))
                if r["placed_as_measured"]]
        within += sum(r["step_s"][r["picks"]["step"]] <= 1.05 * min(r["step_s"].values()) for r in rows)
        total += len(rows)
    assert (within, total) == (within_5, 2)


def test_calibrate_reads_rates_from_calls_back_to_back_and_a_call_alone_from_its_own_start(monkeypatch):
    """exec/calibrate.py: a rate is the median time per call among calls queued back to back (no
    host synchronisation between them, which would add the host's wake-up to every transfer); a
    lone call is timed from its own start. A fake clock gives each call a known duration; the
    first call is the warm-up and is not counted."""
    from dtcp.exec import calibrate as calibrate_module

    clock = [0.0]
    durations = iter([100.0, 3.0, 1.0, 2.0, 50.0, 4.0, 100.0, 3.0, 1.0, 2.0, 50.0, 4.0])
    monkeypatch.setattr(calibrate_module.time, "perf_counter", lambda: clock[0])

    def call():
        clock[0] += next(durations)

    cpu = torch.device("cpu")
    assert calibrate_module.timed_back_to_back(call, cpu, 5) == 3.0  # median of 3, 1, 2, 50, 4
    barriers = []
    monkeypatch.setattr(calibrate_module.dist, "barrier", lambda group: barriers.append(group))
    assert calibrate_module.timed(call, cpu, 5, group="the group") == 3.0
    assert barriers == ["the group"] * 5  # the ranks start every timed call together
    with pytest.raises(StopIteration):  # each took exactly 1 warm-up + 5 calls
        call()
