"""GPU tests: run on a machine with at least two CUDA GPUs (NCCL, one process per GPU):

    NCCL_NVLS_ENABLE=0 python -m pytest -q -s tests/gpu

On a machine without them the whole folder is skipped (it is part of `pytest tests`, which CI runs
on CPU)."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: dist_harness, reference
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))  # check_correctness


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs 2 CUDA GPUs (docs/getting-started.md: run tests/gpu on the GPU machines)")
    for item in items:
        if os.path.dirname(str(item.fspath)) == HERE:
            item.add_marker(skip)
