"""GPU tests: most run on a machine with at least two CUDA GPUs (NCCL, one process per GPU); those
marked one_gpu simulate N ranks on one GPU:

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


def pytest_configure(config):
    config.addinivalue_line("markers", "one_gpu: runs on one CUDA GPU (N ranks simulated in one process)")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_two = pytest.mark.skip(reason="needs 2 CUDA GPUs (docs/getting-started.md: run tests/gpu on the GPU machines)")
    skip_one = pytest.mark.skip(reason="needs a CUDA GPU (docs/getting-started.md: run tests/gpu on the GPU machines)")
    for item in items:
        if os.path.dirname(str(item.fspath)) != HERE:
            continue
        needed = 1 if item.get_closest_marker("one_gpu") else 2
        if gpus < needed:
            item.add_marker(skip_one if needed == 1 else skip_two)
