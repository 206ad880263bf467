"""benchmarks/bench_train_step.py on CPU (2 gloo ranks, float32, tiny layers): every strategy that
serves the batch gives a step time, auto's pick under each cost objective is recorded and
strategy="auto" itself runs under each, and the replay of the JSON gives the same picks. Nothing
is judged by time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = ("pareto", "docs-balanced")  # (bench_split's mixes and bench_strategies' documents)


def test_cpu_smoke_run_and_replay(tmp_path):
    out = tmp_path / "train_step.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_train_step.py"), "--device", "cpu", "--dim", "32", "--ffn", "64",
           "--heads", "4/2", "--head-dim", "16", "--seq", "2048", "--layers", "1", "--iters", "1",
           "--masks", *MASKS, "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        run = json.load(f)
    assert run["world_size"] == 2 and run["device"] == "cpu"
    assert [row["mask"] for row in run["rows"]] == list(MASKS)
    for row in run["rows"]:
        # (the all-gather takes a Balanced batch only with a one-launch varlen kernel: not on CPU)
        assert {"ring", "ulysses"} <= set(row["step_s"]), row
        assert all(0 < t < math.inf for t in row["step_s"].values()), row
        assert set(row["picks"]) == {"call", "device", "step"}, row
        assert set(row["picks"].values()) <= {"ring", "allgather", "ulysses"}, row
        # strategy="auto" itself ran under each objective (on CPU its live route is the ring)
        assert set(row["auto_step_s"]) == {"call", "device", "step"}, row
        assert all(0 < t < math.inf for t in row["auto_step_s"].values()), row
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_train_step
        replayed = bench_train_step.replay(str(out))
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    assert [r["picks"] for r in replayed] == [r["picks"] for r in run["rows"]]
