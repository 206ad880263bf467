"""benchmarks/bench_placement.py on CPU with tiny shapes: the baseline placement is the one in
force while its plans are built (a contiguous baseline shows zigzag-free imbalance), this
checkout's placement is restored after, and every figure is finite. Never timed."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_placement  # noqa: E402
import dtcp.layouts.balanced as balanced  # noqa: E402

CONTIGUOUS = '''
def _placement(doc_lens, world_size, min_chunk):
    per = sum(doc_lens) // world_size
    return tuple(((r * per, (r + 1) * per),) for r in range(world_size))
'''


def test_baseline_in_force_then_restored(tmp_path):
    path = tmp_path / "contiguous.py"
    path.write_text(CONTIGUOUS)
    before = balanced._placement
    rows = bench_placement.main(["--baseline", str(path), "--device", "cpu", "--seq-scale", "1/512",
                                 "--points", "lognormal-s1:4", "--rounds", "1", "--reps", "1"])
    assert balanced._placement is before
    (row,) = rows
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("baseline_ms", "this_ms"))
    # contiguous runs over a long-tailed mix are far from balanced; Balanced is within its tolerance
    assert row["baseline_imbalance"] > 1.3 and row["this_imbalance"] < 1.05, row
    assert row["baseline_steps"] == 2 and row["this_steps"] >= 1, row  # contiguous: the local step and offset 1


def test_hidden_steps_against_none():
    """--hidden-steps all: this checkout's placement counting the device alone against the one that
    counts every step's host time, both in force while their plans are built. bench_split's
    log-normal s0 at 1/16 scale (8K tokens) over 16 ranks: the two differ (by the placements'
    own work: 2.31x the mean's pairs on one rank in one step with every step's host time counted,
    1.22x in two steps with the device alone), and the module's placement is restored after."""
    before = balanced._placement
    rows = bench_placement.main(["--hidden-steps", "all", "--device", "cpu", "--seq-scale", "1/16",
                                 "--points", "lognormal-s0:16", "--rounds", "1", "--reps", "1"])
    assert balanced._placement is before
    (row,) = rows
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("baseline_ms", "this_ms", "baseline_device_ms",
                                                               "this_device_ms"))
    assert row["baseline_imbalance"] > 2.3 and row["this_imbalance"] < 1.25, row
    assert row["baseline_steps"] < row["this_steps"], row
