"""benchmarks/bench_new_batch.py on CPU with small batches: every stage is timed for every point,
the digest it times is the one the HF block agrees on, the route is built for the resolved
`Balanced` placement, and the JSON holds what the docs quote. Never timed: only that the figures
exist and are finite."""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_new_batch  # noqa: E402
from dtcp.comm.guard import tensor_digest  # noqa: E402
from dtcp.integrations.transformers import batch as hf_batch  # noqa: E402


def test_every_stage_of_every_point(tmp_path):
    out = tmp_path / "new_batch.json"
    bench_new_batch.main(["--cases", "pareto-s1", "lognormal-s0", "--world-sizes", "2", "4", "--batches", "2",
                          "--heads", "4/2", "--head-dim", "16", "--seq-scale", "0.0625", "--json", str(out)])
    data = json.loads(out.read_text())
    points = data["points"]
    assert [(p["case"], p["world_size"]) for p in points] == [("pareto-s1", 2), ("pareto-s1", 4),
                                                               ("lognormal-s0", 2), ("lognormal-s0", 4)]
    for p in points:
        assert p["batches"] == 2 and p["seq_len"] == 8192 and p["picks"], p
        for key in ("ids_digest_ms", "ids_text_digest_ms", "boundaries_ms", "placement_ms", "route_ms", "total_ms"):
            assert math.isfinite(p[key]) and p[key] >= 0, (key, p)
        assert p["total_ms"] >= p["route_ms"]


def test_its_batch_is_the_blocks(monkeypatch):
    """The benchmark's packed row gives the boundaries the HF block finds, and the block's
    agreement field for the ids is the digest the benchmark times (rank 0 of 2, no process group:
    the group's size and rank are all the block reads of it here)."""
    from dtcp.layouts import sharding

    monkeypatch.setattr(hf_batch, "cp_size_and_rank", lambda group: (2, 0))
    monkeypatch.setattr(sharding, "cp_size_and_rank", lambda group: (2, 0))
    docs = [5, 300, 64, 7]
    ids, pos = bench_new_batch.packed_batch(docs)
    starts = hf_batch._boundaries_from_positions(pos)
    cu = hf_batch._cu_seqlens(starts, sum(docs))
    assert cu.tolist()[:5] == [0, 5, 305, 369, 376]
    inputs, error, fields, layout = hf_batch.prepare_batch({"input_ids": ids, "position_ids": pos}, None,
                                                           hf_batch.Auto())
    assert error is None and type(layout).__name__ == "Balanced"
    assert fields["input_ids"] == tensor_digest(ids)
    assert inputs["input_ids"].shape == (1, 188)
