"""benchmarks/bench_split.py on CPU with tiny shapes: every field of its JSON, ratios positive and
finite, kernel calls counted, and Balanced's slowest rank with less work than zigzag's on a
long-tailed mix. Work is counted from the plans (visible (query, key) pairs), never timed."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_split  # noqa: E402

POINT_FIELDS = ("case", "mask", "seq_len", "heads", "world_size", "layout", "strategy", "kernel", "exchange", "plan",
                "slowest_ms", "slowest_fwd_ms", "split", "split_fwd", "total_work_ratio", "total_work_estimated",
                "launches_fwd", "launches_bwd", "max_work", "work_imbalance", "work_per_rank", "peak_mib", "ranks",
                "slowest_device_ms", "split_device", "device_rank", "kernel_ms", "other_ms", "host_ms",
                "host_rest_ms", "kernel_efficiency", "bound", "steady_ms", "steady_rank", "split_steady",
                "steady_attn_ms", "steady_other_ms", "attn_efficiency", "launch_efficiency")
RANK_FIELDS = ("rank", "weight", "ms", "fwd_ms", "iters", "launches_fwd", "launches_bwd", "work", "peak_mib",
               "device_ms", "host_ms", "host_rest_ms", "host_kernel_ms", "kernel_ms", "steady_ms", "steady_attn_ms",
               "steady_calls_ms", "launch_work")
CASES = ("causal-32k", "window-128k", "docs-16x8k", "pareto-s0")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("split") / "split.json"
    # (at 1/512 scale Balanced's minimum chunk scales to 1 token: the long documents are cut as at full size)
    return _run(out)


def _run(out):
    return bench_split.main([
        "--device", "cpu", "--dtype", "float32", "--seq-scale", "1/512", "--heads", "4/2", "--head-dim", "16",
        "--world-sizes", "2", "4", "--cases", *CASES, "--iters", "1", "--warmup", "1", "--point-seconds", "0",
        "--max-seconds", "0", "--out", str(out),
    ]) | {"_path": str(out)}


def test_json_has_every_field(results):
    import json

    with open(results["_path"]) as f:
        on_disk = json.load(f)
    assert on_disk["errors"] == [] and on_disk["skipped"] == []
    assert {c["name"] for c in on_disk["cases"]} == set(CASES)
    for case in on_disk["cases"]:
        ref = case["one_device"]["4/2"]
        assert ref["ms"] > 0 and ref["fwd_ms"] > 0 and ref["launches_fwd"] > 0 and ref["launches_bwd"] > 0
        assert 0 < ref["kernel_ms"] <= ref["device_ms"] and ref["host_ms"] > 0
        assert 0 < ref["steady_attn_ms"] <= ref["steady_ms"]  # (CPU: wall times)
    points = [p for p in on_disk["points"] if "not_applicable" not in p]
    # every case, both N, every layout of the case ran the ring
    for case in on_disk["cases"]:
        for n in (2, 4):
            for layout in case["layouts"]:
                assert any(p["case"] == case["name"] and p["world_size"] == n and p["layout"] == layout
                           and p["strategy"] == "ring" for p in points), (case["name"], n, layout)
    assert {p["strategy"] for p in points} >= {"ring", "allgather", "ulysses", "hybrid 2x2"}
    for p in points:
        for key in POINT_FIELDS:
            assert key in p, (key, p["case"], p["strategy"])
        for key in ("split", "split_fwd", "total_work_ratio", "slowest_ms", "work_imbalance"):
            assert p[key] > 0 and math.isfinite(p[key]), (key, p)
        assert p["launches_fwd"][0] > 0 and p["launches_bwd"][0] > 0, p
        assert len(p["work_per_rank"]) == p["world_size"] or p["strategy"] != "ring"
        for r in p["ranks"]:
            for key in RANK_FIELDS:
                assert key in r, (key, p["case"], p["strategy"])
            # the attention calls' own time is part of the pass's (on CPU: wall times of both)
            assert 0 < r["kernel_ms"] <= r["device_ms"], (p["case"], p["strategy"], r)
            assert r["host_rest_ms"] > 0 and r["host_kernel_ms"] == r["host_ms"] - r["host_rest_ms"], r
        assert p["split_device"] > 0 and p["kernel_efficiency"] > 0 and p["other_ms"] >= 0, p
        assert p["split_steady"] > 0 and p["attn_efficiency"] > 0 and p["steady_other_ms"] >= 0, p
        if p["strategy"] == "ring":  # each call's efficiency and share; the shares are the rank's
            slow = next(r for r in p["ranks"] if r["rank"] == p["steady_rank"])
            assert len(slow["launch_work"]) == len(p["launch_efficiency"]) > 0, p["case"]
            assert all(f > 0 and b > 0 and 0 < w <= 1 for f, b, w in p["launch_efficiency"]), p
            total = sum(p["work_per_rank"])
            assert abs(sum(w for _, _, w in p["launch_efficiency"]) - slow["work"] / total) < 1e-9
        assert p["bound"] in ("host", "device")
    # the auto check: a pick for every (case, heads, N, layout), and the fraction printed
    assert len(on_disk["auto"]) == sum(len(c["layouts"]) for c in on_disk["cases"]) * 2
    for a in on_disk["auto"]:
        assert a["pick"] in ("ring", "allgather", "ulysses") and a["within_5pct"] in (True, False), a
    summary = on_disk["auto_summary"]
    assert summary["points"] == len(on_disk["auto"]) and 0 <= summary["fraction"] <= 1
    assert 0 <= summary["kernel_model_within_5pct"] <= summary["points"]
    assert on_disk["meta"]["complete"]


def test_balanced_slowest_rank_has_less_work_than_zigzag_on_a_long_tailed_mix(results):
    case = next(c for c in results["cases"] if c["name"] == "pareto-s0")
    assert max(case["docs"]) > 4 * min(case["docs"])  # long-tailed indeed
    for n in (2, 4):
        ring = {p["layout"]: p for p in results["points"]
                if p["case"] == "pareto-s0" and p["world_size"] == n and p["strategy"] == "ring"}
        assert ring["balanced"]["max_work"] < ring["zigzag"]["max_work"], (n, ring["balanced"]["work_per_rank"],
                                                                          ring["zigzag"]["work_per_rank"])
        # every rank's work, summed, is the whole mask's: nothing lost, nothing counted twice
        assert sum(ring["balanced"]["work_per_rank"]) == sum(ring["zigzag"]["work_per_rank"])


def test_plot_from_json_without_running(results, tmp_path):
    again = bench_split.main(["--plot-from", results["_path"], "--plot", str(tmp_path / "split.png")])
    assert again["points"] == [p for p in results["points"]]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # the function says so and makes none
    assert (tmp_path / "split.png").stat().st_size > 0


def test_lognormal_fit_matches_the_published_histogram():
    mu, sigma = bench_split.lognormal_fit()
    assert abs(mu - 5.80) < 0.01 and abs(sigma - 1.25) < 0.01  # the figures the docstring cites
    docs = bench_split.lognormal_docs(1 << 17, 0, 1.0)
    assert sum(docs) == 1 << 17 and min(docs) >= 1


def test_replay_rejudges_the_picks_without_a_gpu(results):
    """--replay: the picks of a measured grid made anew by this checkout's cost model (meta
    tensors), against the grid's measured times; the same picks here, where nothing changed."""
    replayed = bench_split.main(["--replay", results["_path"]])
    before = {(a["case"], a["heads"], a["world_size"], a["layout"]): a["pick"] for a in results["auto"]}
    after = {(a["case"], a["heads"], a["world_size"], a["layout"]): a["pick"] for a in replayed["auto"]}
    assert after == before and len(after) > 0  # (the smoke grid's picks were made on meta tensors too)
    assert replayed["auto_summary"]["points"] == results["auto_summary"]["points"]


def test_steady_figures_decide_the_bound():
    """device_summary: split_steady compares steady (loaded-clock) times like for like, and the
    bound is the host where the wall-slowest rank's host time to queue its pass exceeds its device
    time (behind a sleep), else the device."""
    ref = dict(ms=100.0, device_ms=95.0, kernel_ms=90.0, steady_ms=98.0, steady_attn_ms=96.0)

    def rank(r, steady, attn, host, work=1):
        return dict(rank=r, ms=steady + 0.5, device_ms=steady - 2, kernel_ms=attn - 2, host_ms=host,
                    steady_ms=steady, steady_attn_ms=attn, work=work)

    out = bench_split.device_summary([rank(0, 26.0, 24.0, 5.0), rank(1, 24.5, 24.0, 5.0)], ref, 4, 2)
    assert out["bound"] == "device" and out["steady_rank"] == 0
    assert abs(out["split_steady"] - 24.5 / 26.0) < 1e-12 and abs(out["steady_other_ms"] - 2.0) < 1e-12
    assert abs(out["attn_efficiency"] - 96.0 * 0.5 / 24.0) < 1e-12
    out = bench_split.device_summary([rank(0, 20.0, 18.0, 19.0), rank(1, 19.0, 18.0, 5.0)], ref, 4, 2)
    assert out["bound"] == "host"  # 19 ms to queue a pass whose device time is 18


def test_launch_efficiency_from_the_calls_and_their_work():
    """Each launch's forward and backward time against its share of the one device's calls."""
    ref = dict(steady_calls_ms=[10.0, 30.0])
    rank = dict(launch_work=[60, 20, 20], steady_calls_ms=[0.8, 0.25, 0.2, 2.5, 0.6, 0.75])
    got = bench_split.launch_efficiency(rank, ref, 1000)
    want = [[10 * 0.06 / 0.8, 30 * 0.06 / 2.5, 0.06], [10 * 0.02 / 0.25, 30 * 0.02 / 0.6, 0.02],
            [10 * 0.02 / 0.2, 30 * 0.02 / 0.75, 0.02]]
    assert all(abs(a - b) < 1e-12 for g, w in zip(got, want) for a, b in zip(g, w)) and len(got) == 3
    # calls that are not the launches (a count that does not match), or no launch work: none
    assert bench_split.launch_efficiency(dict(rank, steady_calls_ms=[1.0] * 5), ref, 1000) is None
    assert bench_split.launch_efficiency(dict(rank, launch_work=None), ref, 1000) is None


def test_launch_work_sums_to_the_rank_work():
    """launch_work: one entry per kernel call of a ring rank, fused launches or tasks, summing to
    the rank's work (pairs x heads), with a one-launch kernel and without."""
    import dataclasses

    import torch
    from dtcp.kernels import KERNELS

    cases = {c.name: c for c in bench_split.build_cases(1 / 64)}
    for name, layout in (("pareto-s0", "balanced"), ("causal-32k", "zigzag")):
        point = bench_split.make_point(cases[name], layout, 4, 2, 16, 4, "auto")
        for job in bench_split.rank_jobs(point, "ring", torch.device("cpu"), torch.float32):
            for kernel in (job.kernel, KERNELS["fa4"]):
                work = bench_split.launch_work(dataclasses.replace(job, kernel=kernel), torch.device("cpu"))
                assert sum(work) == job.work and all(w > 0 for w in work), (name, job.rank, kernel.name)


@pytest.mark.parametrize("one_launch", [False, True])
def test_a_replayed_pass_makes_no_kernel_call_and_gives_the_recorded_results(one_launch, monkeypatch):
    """Timer.host_split's replay (`replaying`): with the kernel's calls recorded in one pass, a
    replayed pass calls the kernel not once (so its host time is dtcp's alone) and returns the
    same gradients, bit for bit (so it is the same pass, with the same merges and adds). Task by
    task, and fused (one_launch: the CPU kernel's varlen loop standing in for one launch, its
    dense calls nested inside: each outermost call replays)."""
    import torch
    from dtcp.kernels import KERNELS

    cases = {c.name: c for c in bench_split.build_cases(1 / 64)}
    point = bench_split.make_point(cases["pareto-s0"], "balanced", 4, 2, 16, 4, "auto")
    job = max(bench_split.rank_jobs(point, "ring", torch.device("cpu"), torch.float64), key=lambda j: j.work)
    kernel = job.kernel
    monkeypatch.setattr(type(kernel), "varlen_one_launch", one_launch)
    from dtcp.exec.fused import fused_steps
    assert (fused_steps(job.plan, kernel, torch.device("cpu")) is not None) == one_launch
    fwd, bwd = bench_split.job_passes(job, torch.device("cpu"), torch.float64, 0.25)
    recorded, counts = [], {"fwd": 0, "bwd": 0}
    with bench_split.replaying(kernel, recorded, record=True):
        want = bwd(fwd())
    assert recorded and not any(name in kernel.__dict__ for name in bench_split._KERNEL_METHODS)
    with bench_split.counting(kernel, counts):
        with bench_split.replaying(kernel, recorded, record=False):
            got = bwd(fwd())
    assert counts == {"fwd": 0, "bwd": 0}
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 3
    # and a real pass after it calls the kernel as before (nothing left patched)
    with bench_split.counting(kernel, counts):
        bwd(fwd())
    fused = fused_steps(job.plan, kernel, torch.device("cpu"))
    launches = sum(len(s.tasks) for s in job.plan.steps) if fused is None else sum(len(site) for site in fused)
    assert counts["fwd"] == launches > 0 and counts["bwd"] > 0
    assert KERNELS[kernel.name] is kernel


def test_profile_names_the_dtcp_functions_that_spend_the_time(capsys):
    """--profile's table of torch ops by the dtcp function that issued them: on CPU the kernel's
    own op is charged to dtcp's kernel wrapper, the ring's copies to the ring."""
    bench_split.main(["--device", "cpu", "--dtype", "float32", "--seq-scale", "1/512", "--heads", "4/2",
                      "--head-dim", "16", "--world-sizes", "2", "--cases", "pareto-s0", "--strategies", "ring",
                      "--layouts", "balanced", "--iters", "1", "--warmup", "1", "--point-seconds", "0",
                      "--max-seconds", "0", "--profile"])
    text = capsys.readouterr().out
    table = text.split("by the dtcp function that issued them:\n", 1)[1].split("   host (cProfile", 1)[0]
    rows = [line.split() for line in table.strip().splitlines()]
    assert rows and all(r[1] == "ms" and float(r[0]) >= 0 and r[2].endswith("x") for r in rows), table
    assert any(r[3].startswith("aten::_scaled_dot_product") and r[4].startswith("kernels/") for r in rows), table
    assert any(r[4].startswith("exec/") for r in rows), table
    # the host's cProfile summed by where the code lives: dtcp's own Python among it
    sums = text.split("own time by where the code lives, ms: ", 1)[1].split("\n", 1)[0]
    assert float(dict(part.rsplit(" ", 1) for part in sums.split(", "))["dtcp"]) > 0, sums


def test_require_fa4_stops_before_any_run():
    """--require-fa4 where FA4 does not serve (this CPU): a SystemExit naming the reason, before a
    single point runs (a GPU machine started bare would otherwise time cuDNN and flash)."""
    with pytest.raises(SystemExit, match="--require-fa4, but fa4 does not serve here: "):
        bench_split.main(["--device", "cpu", "--require-fa4", "--cases", "pareto-s0", "--world-sizes", "2"])


def test_every_collective_of_the_allgather_has_a_local_stand_in():
    """bench_split runs the all-gather without a process group: every collective that
    dtcp/exec/allgather.py calls must be replaced, or a point fails on the GPU (as `exchange_rows`
    did, unreplaced, on the twenty-ninth session's code: "Default process group has not been
    initialized")."""
    import inspect

    from dtcp.comm import collectives
    from dtcp.exec import allgather as exec_allgather

    called = {name for name, fn in vars(exec_allgather).items()
              if inspect.isfunction(fn) and fn.__module__ == collectives.__name__}
    assert called == set(bench_split.COLLECTIVES)
    with bench_split.local_collectives():
        assert all(getattr(exec_allgather, name) is not getattr(collectives, name) for name in called)
    assert all(getattr(exec_allgather, name) is getattr(collectives, name) for name in called)


def test_allgather_over_documents_with_the_key_exchange_runs_without_a_process_group(monkeypatch):
    """The all-gather's one varlen launch over a long-tailed mix (the CPU kernel's varlen loop
    standing in for one launch), where only the keys other ranks read move: every rank's pass
    runs under the stand-ins, with rows moving each way, and gives finite gradients of its
    shapes."""
    import torch
    from dtcp.config import config as dtcp_config
    from dtcp.kernels import KERNELS

    cases = {c.name: c for c in bench_split.build_cases(1 / 64)}
    point = bench_split.make_point(cases["pareto-s0"], "balanced", 4, 2, 16, 4, "auto")
    for name in ("math", "cpu_flash"):  # (whichever "auto" picks on CPU)
        monkeypatch.setattr(type(KERNELS[name]), "varlen_one_launch", True)
    with dtcp_config.override(allgather_exchange=True):
        jobs = bench_split.rank_jobs(point, "allgather", torch.device("cpu"), torch.float64)
        exchanges = [j.plan.exchange for j in jobs]
        assert all(x is not None for x in exchanges) and any(x.moves for x in exchanges)
        for j in jobs:
            fwd, bwd = bench_split.job_passes(j, torch.device("cpu"), torch.float64, 0.25)
            with bench_split.local_collectives():
                dq, dk, dv = bwd(fwd())
            assert dq.shape == j.q_shape and dk.shape == dv.shape == j.kv_shape
            assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))


def test_balanced_variants_run_beside_the_cases_own_layouts():
    """--layouts balanced@<min_chunk>+<hidden_steps or N>: that Balanced, on the document cases only,
    after the case's own layouts."""
    cases = {c.name: c for c in bench_split.build_cases(1.0)}
    assert bench_split.case_layouts(cases["pareto-s0"], ["balanced", "balanced@128+N"]) == \
        ["balanced", "balanced@128+N"]
    assert bench_split.case_layouts(cases["causal-32k"], ["zigzag", "balanced@128+N"]) == ["zigzag"]
    assert bench_split.case_layouts(cases["pareto-s0"], None) == list(cases["pareto-s0"].layouts)
    assert bench_split.balanced_variant("balanced@128+N", 16, 512) == dict(min_chunk=128, hidden_steps=16)
    assert bench_split.balanced_variant("balanced+3", 16, 512) == dict(min_chunk=512, hidden_steps=3)
    assert bench_split.balanced_variant("balanced@64", 8, 512) == dict(min_chunk=64, hidden_steps=0)
    with pytest.raises(ValueError, match="balanced@128\\+N"):
        bench_split.balanced_variant("balanced@x+N", 8, 512)
    point = bench_split.make_point(cases["lognormal-s0"], "balanced@128+N", 32, 8, 128, 16, "auto")
    assert point.layout.min_chunk == 128 and point.layout.hidden_steps == 16
    assert point.args.layout == "balanced@128+16"
