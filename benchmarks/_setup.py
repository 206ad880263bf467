"""Shared start-up for the torchrun scripts in benchmarks/."""

import os

import torch
import torch.distributed as dist


def init_distributed(device_name: str) -> torch.device:
    """Bind this process to its GPU (LOCAL_RANK) and start NCCL, or gloo for device 'cpu'."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device
