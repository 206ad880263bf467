"""benchmarks/bench_replay.py on CPU: dtcp's fa4 kernel over the CPU stand-in of FA4's interface
(tests/test_kernel_replay.py `_compiled_fa4`), every part of the benchmark run once, small. Never
timed: only that every call records and replays, that the replayed forward gives the wrapper's
bits, and that the figures exist."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_replay  # noqa: E402
from test_kernel_replay import install_compiled_fa4  # noqa: E402


def test_every_part_runs_and_replays(monkeypatch, capsys):
    install_compiled_fa4(monkeypatch)
    got = bench_replay.main(["--device", "cpu", "--calls", "4", "--rows", "256", "--breakdown"])
    names = [row["call"] for row in got["calls"]]
    assert names == ["varlen forward_into, 8 documents", "varlen backward, 8 documents",
                     "varlen forward_into, 40 documents", "varlen backward, 40 documents",
                     "dense causal forward", "dense causal backward"]
    for row in got["calls"]:
        for key in ("wrapper_us", "recording_us", "replayed_us"):
            assert math.isfinite(row[key]) and row[key] > 0, row
        assert row["same_forward_bits"] is ("forward" in row["call"] or None), row
    assert all(v > 0 for v in got["launch_host_s"].values())
    for which in ("fwd", "bwd"):
        stats = got["stats"][which]
        assert stats["refused"] == 0 and stats["recorded"] > 0 and stats["replayed"] > stats["recorded"], stats
    printed = capsys.readouterr().out
    assert "signature" in printed and "launch" in printed  # (the breakdown: each program's steps)
