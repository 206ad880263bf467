"""Failure injection shared by the CPU and GPU failure tests."""

from __future__ import annotations

import torch.distributed as dist

from dtcp.kernels.math import MathKernel


class FailingKernel(MathKernel):
    """The math kernel, except that on `rank` its `at`-th forward call raises (an OOM, a kernel
    error: anything inside the op after the ring has started). Register it in
    dtcp.kernels.KERNELS["test_failing"] and name it as the backend."""

    name = "test_failing"

    def __init__(self, rank: int, at: int):
        self.rank, self.at, self.calls = rank, at, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.at:
            raise RuntimeError("CUDA out of memory (injected by the test)")
        return super().forward(*args, **kwargs)
