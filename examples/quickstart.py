"""Ring attention on 2+ ranks, checked against single-device attention.

    torchrun --nproc-per-node 2 examples/quickstart.py            # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 4 examples/quickstart.py --seq-len 32768 --dtype bfloat16

Every rank builds the same full q, k, v, keeps its shard in the chosen layout, runs
dtcp.ring_attention forward and backward, and compares with F.scaled_dot_product_attention on
the full sequence (rank 0 prints the worst relative error over ranks and the time taken).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtcp


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag", help="contiguous | zigzag | striped[:block]")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--backend", default="auto")
    p.add_argument("--no-causal", action="store_true")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    layout = dtcp.layout_from_spec(args.layout)
    causal = not args.no_causal

    g = torch.Generator(device="cpu").manual_seed(0)
    shape = lambda h: (1, h, args.seq_len, args.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=g).to(device, dtype) for h in (args.heads, args.kv_heads, args.kv_heads))
    dout = torch.randn(shape(args.heads), generator=g).to(device, dtype)

    # reference: the whole sequence on one device
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    ref.backward(dout)

    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    dist.barrier()
    t0 = time.perf_counter()
    out = dtcp.ring_attention(*local, layout=layout, is_causal=causal, enable_gqa=True, backend=args.backend)
    out.backward(layout.shard(dout, dim=2))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    def err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    errs = torch.tensor([
        err(out, layout.shard(ref, dim=2)),
        *(err(l.grad, layout.shard(f.grad, dim=2)) for l, f in zip(local, full)),
        elapsed,
    ], dtype=torch.float64, device=device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if rank == 0:
        e = errs.tolist()
        print(f"dtcp ring attention: {world} ranks, {device.type}, {dtype}, layout={layout.spec()}, "
              f"causal={causal}, S={args.seq_len}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}")
        print(f"max relative error vs single-device SDPA: out {e[0]:.2e}  dq {e[1]:.2e}  dk {e[2]:.2e}  dv {e[3]:.2e}")
        print(f"time (first call, fwd+bwd, max over ranks): {e[4] * 1e3:.1f} ms")
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
