"""The Hugging Face examples as a user runs them: `torchrun --nproc-per-node 2 examples/<x>.py
--cp 2 --check` on 2 gloo ranks (CPU: float32 or float64). Each trains a tiny model from config
on packed documents with context parallelism, then without it in one process, and fails unless
every step's loss agrees (the examples' own tolerances). The same commands ran on 2 H200s in bf16
(docs/performance-log.md, twenty-eighth session)."""

from __future__ import annotations

import re

import pytest

from test_example import run_example


@pytest.mark.parametrize("name,needs", [("hf_finetune.py", "transformers"), ("hf_trainer.py", "accelerate"),
                                        ("trl_sft.py", "trl")])
def test_hf_example_check_cpu(name, needs):
    pytest.importorskip(needs)  # (installed by the README's dev install: the transformers and trainer extras)
    rc, out = run_example(name, "--cp", "2", "--check", timeout=420)
    assert rc == 0, out[-4000:]
    found = re.search(r"check: worst relative loss difference ([0-9.e+-]+) \(tolerance ([0-9.e+-]+)", out)
    assert found is not None, out[-4000:]
    worst, tol = float(found.group(1)), float(found.group(2))
    assert worst <= tol <= 1e-4, (worst, tol)
