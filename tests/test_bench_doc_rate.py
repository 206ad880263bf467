"""benchmarks/bench_doc_rate.py on CPU (the math kernel, small lengths): every document length
that divides the tokens is measured, the pairs are those of the causal documents, the longest is
the reference (rate 1), and the JSON holds what the docs quote. Never timed: only that the
figures exist and are finite."""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_doc_rate  # noqa: E402


def test_every_document_length(tmp_path):
    out = tmp_path / "rate.json"
    bench_doc_rate.main(["--device", "cpu", "--tokens", "1024", "--heads", "2/1", "--head-dim", "16", "--reps", "1",
                         "--json", str(out)])
    points = json.loads(out.read_text())["points"]
    assert [p["doc_len"] for p in points] == [1024, 512, 256, 128]
    assert points[0]["relative_rate"] == 1.0
    for p in points:
        assert p["pairs"] == p["docs"] * p["doc_len"] * (p["doc_len"] + 1) // 2
        assert p["docs"] * p["doc_len"] == 1024
        for key in ("fwd_ms", "bwd_ms", "relative_rate"):
            assert math.isfinite(p[key]) and p[key] > 0, (key, p)
