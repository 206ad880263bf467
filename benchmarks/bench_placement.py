"""Two Balanced placements of the same batches, timed against each other on one device.

For each point (a bench_split long-tailed case and N), every simulated rank's ring forward +
backward runs through dtcp's executors with `NoComm` (as in bench_split.py), once with this
checkout's placement and once with a baseline's: the `balanced.py` of another revision, loaded
beside this one. The two are timed interleaved on the same machine (each rank: the best of
`--rounds` medians of `--reps` passes), so host noise that drifts over a run hits both alike.
Prints the slowest rank's ms for each (each pass timed to its end: the host's time to queue it
counts), its device ms (each pass queued behind a GPU sleep: the host's time hidden, as behind a
training step's other layers), the work imbalance and the most steps with work.

    git show f66b0e6:dtcp/layouts/balanced.py > /tmp/balanced_f66b0e6.py
    python benchmarks/bench_placement.py --baseline /tmp/balanced_f66b0e6.py \\
        --points pareto-s1:16 lognormal-s1:8 lognormal-s1:16 lognormal-s0:8

`--hidden-steps all` (or a number) instead compares this checkout's placement with every ring
step's host time counted against the one that counts the device alone (`Balanced(hidden_steps=)`):

    python benchmarks/bench_placement.py --hidden-steps all --points lognormal-s0:16 lognormal-s1:16

Measured on one H100 (2026-11-26): docs/performance.md, "Balanced weighs ring steps".
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import sys
import time
from fractions import Fraction

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_split as B  # noqa: E402
import dtcp.layouts.balanced as balanced  # noqa: E402
from dtcp.plan import ring as ring_plan  # noqa: E402


def load_baseline(path: str):
    """The baseline's placement function, taking this checkout's `_placement` arguments
    (doc_lens, world_size, min_chunk, hidden_steps); a revision without hidden steps places as
    it did."""
    spec = importlib.util.spec_from_file_location("dtcp.layouts._baseline_balanced", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "dtcp.layouts"  # its relative imports (.base) resolve in this checkout
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    if "hidden_steps" in inspect.signature(module._placement).parameters:
        return module._placement
    return lambda doc_lens, world_size, min_chunk, hidden_steps=0: module._placement(doc_lens, world_size, min_chunk)


def with_hidden_steps(hidden: str):
    """This checkout's placement with `hidden` steps hidden ("all": N), whatever a call asks."""
    real = balanced._placement

    def placement(doc_lens, world_size, min_chunk, hidden_steps=0):
        return real(doc_lens, world_size, min_chunk, world_size if hidden == "all" else min(int(hidden), world_size))
    return placement


def rank_passes(case, n: int, placement, device, dtype, min_chunk: int):
    """One callable per simulated rank (its ring forward + backward) with `placement` in force
    while the plans are built; plus the point's work imbalance and most steps with work."""
    current = balanced._placement
    balanced._placement = placement
    ring_plan.ring_plans.cache_clear()
    try:
        point = B.make_point(case, "balanced", 32, 8, 128, n, "auto", min_chunk)
        jobs = B.rank_jobs(point, "ring", device, dtype)
    finally:
        balanced._placement = current
        ring_plan.ring_plans.cache_clear()
    passes = []
    for job in jobs:
        fwd, bwd = B.job_passes(job, device, dtype, point.args.scale)
        passes.append(lambda fwd=fwd, bwd=bwd: bwd(fwd()))
    works = [j.work for j in jobs]
    steps = max(1 + sum(1 for s in j.plan.steps[1:] if s.tasks) for j in jobs)
    return passes, max(works) * len(works) / max(1, sum(works)), steps


def device_ms(once, reps: int, device, host_ms: float) -> float:
    """The median device time of `once` queued behind a GPU sleep that outlasts the host's time to
    queue it (as a training step's other layers keep the device busy while the host runs ahead):
    host gaps do not count. On CPU: the wall time."""
    if device.type != "cuda":
        return median_ms(once, reps, device)
    cycles = int((2 * host_ms + 2.0) * B.sleep_cycles_per_ms())
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def median_ms(once, reps: int, device) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None,
                   help="a balanced.py of another revision (git show REV:dtcp/layouts/balanced.py); default: this "
                        "checkout's placement with no hidden steps")
    p.add_argument("--hidden-steps", default="0",
                   help="this checkout's placement with this many ring steps' host time hidden (Balanced(hidden_steps=)); "
                        "'all': N")
    p.add_argument("--points", nargs="+", required=True, help="case:N, e.g. lognormal-s1:16 (bench_split's long-tailed cases)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seq-scale", default="1", help="every length times this (1/512 for a CPU smoke run)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = float(Fraction(args.seq_scale))
    min_chunk = max(1, round(balanced.MIN_CHUNK * scale))
    cases = {c.name: c for c in B.build_cases(scale)}
    if args.baseline is None and args.hidden_steps == "0":
        p.error("give --baseline, or --hidden-steps to compare with this checkout's placement without hidden steps")
    baseline = load_baseline(args.baseline) if args.baseline else with_hidden_steps("0")
    variants = {"baseline": baseline, "this": with_hidden_steps(args.hidden_steps)}
    rows = []
    with B.local_collectives():
        for item in args.points:
            name, n = item.rsplit(":", 1)
            built = {v: rank_passes(cases[name], int(n), f, device, dtype, min_chunk) for v, f in variants.items()}
            for passes, _, _ in built.values():  # warm up (kernel compiles, allocator)
                for once in passes:
                    once()
                    once()
            best = {v: [float("inf")] * len(passes) for v, (passes, _, _) in built.items()}
            best_device = {v: [float("inf")] * len(passes) for v, (passes, _, _) in built.items()}
            for _ in range(args.rounds):
                for v, (passes, _, _) in built.items():
                    for i, once in enumerate(passes):
                        best[v][i] = min(best[v][i], median_ms(once, args.reps, device))
                        best_device[v][i] = min(best_device[v][i], device_ms(once, args.reps, device, best[v][i]))
            row = dict(case=name, world_size=int(n),
                       **{f"{v}_ms": max(best[v]) for v in built},
                       **{f"{v}_device_ms": max(best_device[v]) for v in built},
                       **{f"{v}_imbalance": built[v][1] for v in built},
                       **{f"{v}_steps": built[v][2] for v in built})
            rows.append(row)
            print(f"{name} N={n}: slowest rank baseline {row['baseline_ms']:.2f} ms, device "
                  f"{row['baseline_device_ms']:.2f} (imbalance {row['baseline_imbalance']:.3f}, "
                  f"{row['baseline_steps']} steps) -> this {row['this_ms']:.2f} ms, device {row['this_device_ms']:.2f} "
                  f"(imbalance {row['this_imbalance']:.3f}, {row['this_steps']} steps)", flush=True)
    return rows


if __name__ == "__main__":
    main()
