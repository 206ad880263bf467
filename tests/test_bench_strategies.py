"""benchmarks/bench_strategies.py's one-GPU reference (--one-gpu) and the split it prints, on CPU
with small shapes in a one-rank gloo group: the reference is bench_split's whole-sequence call
(the same documents, the same window), and a split is (one GPU / N) / the strategy's time."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_split  # noqa: E402
import bench_strategies  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mask", ["causal", "window", "docs", "pareto"])
def test_one_gpu_reference_times_the_masks_whole_sequence(one_rank, mask, monkeypatch):
    seen = []
    real = bench_split.reference

    def spy(case, hq, hkv, d, device, dtype, timer, backend):
        seen.append(case)
        return real(case, hq, hkv, d, device, dtype, timer, backend)

    monkeypatch.setattr(bench_split, "reference", spy)
    s = 1024 if mask == "window" else 512
    seconds = bench_strategies.one_gpu(s, 4, 2, mask, torch.device("cpu"), 1, 0)
    assert math.isfinite(seconds) and seconds > 0
    (case,) = seen
    _, window, cu = bench_strategies.mask_call(mask, s)
    assert case.seq_len == s
    assert case.window == (window[0] if mask == "window" else -1)
    if cu is None:
        assert case.docs is None
    else:
        assert sum(case.docs) == s and case.docs == tuple(b - a for a, b in zip(cu, cu[1:]))


def test_splits_and_their_summary():
    row = {"S": 32768, "heads": "32/8", "mask": "pareto", "pick": "ring", "one_gpu": 0.040,
           "measured": {"ring": 0.0125, "allgather": 0.016, "ulysses": 0.0110}}
    sp = bench_strategies.splits(row, 4)
    assert sp["ring"] == pytest.approx(0.8) and sp["allgather"] == pytest.approx(0.625)
    assert sp["ulysses"] == pytest.approx(10 / 11) and sp["auto"] == sp["ring"]
    text = bench_strategies.split_summary([row, dict(row, one_gpu=None), dict(row, one_gpu=math.nan)], 4)
    assert text.count("S= 32768") == 1
    assert "auto (ring) 0.800, best (ulysses) 0.909" in text


def test_a_failing_reference_is_nan_on_every_rank_not_a_hang(one_rank, monkeypatch, capsys):
    """Rank 0's reference failing (out of memory at the longest lengths) gives NaN, broadcast to
    every rank, and is printed: the other ranks must not wait in the broadcast for a value."""
    def fails(*a, **kw):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench_split, "reference", fails)
    assert math.isnan(bench_strategies.one_gpu(512, 4, 2, "causal", torch.device("cpu"), 1, 0))
    assert "one GPU failed at S=512 causal: RuntimeError: CUDA out of memory (simulated)" in capsys.readouterr().out
