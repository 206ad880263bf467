"""One ring call and a clean exit (torchrun --nproc-per-node 2 benchmarks/smoke_exit.py): the
process must end with exit code 0 after dist.destroy_process_group(), watchdog and all."""

import torch
import torch.distributed as dist

import dtcp
from _setup import init_distributed

device = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
q = torch.randn(1, 8, 4096, 64, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                requires_grad=True)
out = dtcp.ring_attention(q, q, q, layout="zigzag", is_causal=True, strategy="ring")
out.sum().backward()
if device.type == "cuda":
    torch.cuda.synchronize()
print(f"rank {dist.get_rank()}: ring call done, exiting", flush=True)
dist.destroy_process_group()
