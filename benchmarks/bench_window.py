"""Sliding-window ring attention: time against the local compute alone and against full causal.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/bench_window.py --out window.json
    torchrun --nproc-per-node 4 benchmarks/bench_window.py --device cpu --seq-len 512 --heads 2 \
        --head-dim 16 --window 40 --dtype float32 --iters 2 --warmup 1 --out /tmp/window.json

Defaults: bf16, B=1, H=32, D=128, S=131072 in total, causal window 4096, contiguous layout.
Three forward+backward timings, each the median over iterations of one rank, then the max over
ranks (the slowest rank sets the step time):

  windowed ring   dtcp.ring_attention(..., layout=Contiguous(), is_causal=True, window_size=(W, 0))
  local compute   the same kernel on the same blocks (the windowed plan's tasks, K/V of this
                  rank standing in for the received blocks), with the same LSE merges, and no
                  communication: the floor the ring can reach
  full causal     dtcp.ring_attention(..., layout=Zigzag(), is_causal=True): no window
  one GPU         the whole sequence on one GPU with the best kernel for the window (FA4 where
                  installed): the issue's target is windowed <= 1.1 x this / N

The windowed and full causal calls run `--strategy` (default "ring": with "auto" the cost
model may pick Ulysses or the all-gather, and the "windowed ring" line would time those).
Targets: windowed / local <= 1.2, full causal / windowed >= 5. Before timing, a small
correctness check runs the windowed ring with the chosen backend against backend="math"
(fp32 accumulate) on a short sequence with odd window sizes, including right > 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import dtcp
from _setup import init_distributed
from dtcp.comm.p2p import NoComm
from dtcp.exec.ring import ring_backward, ring_forward
from dtcp.kernels import default_scale, select_kernel
from dtcp.layouts import Contiguous
from dtcp.plan import AttnMask, Task, ring_plans


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seq-len", type=int, default=131072, help="total tokens over all ranks")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=4096, help="causal window: window_size=(W, 0)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--strategy", default="ring",
                   help="what the windowed and full causal calls run (default: the ring, which this benchmark is "
                        "about; 'auto' lets the cost model pick, which may be another strategy)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-full", action="store_true", help="skip the full causal ring (slow on CPU)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-one-gpu", action="store_true", help="skip the whole sequence on one GPU (the target's reference)")
    p.add_argument("--out", default=None, help="write results as JSON here (rank 0)")
    return p.parse_args()


class Timer:
    """Wall time of a region: CUDA events on GPU, perf_counter after a barrier on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup, iters):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                torch.cuda.synchronize()
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def max_over_ranks(x: float, device) -> tuple[float, list[float]]:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    vals = [float(p) for p in parts]
    return max(vals), vals


def local_compute(q, k, v, dout, plan, kernel, scale):
    """The windowed plan's kernel calls, merges and float32 accumulation on this rank's own K/V
    (its own spans standing in for the received ones): the ring's own loops with no
    communication (dtcp.exec.ring with NoComm)."""
    out, lse = ring_forward(q, k, v, plan, kernel, scale, NoComm())
    return (out,) + ring_backward(dout, q, k, v, out, lse, plan, kernel, scale, NoComm())


def one_gpu_whole_sequence(args, device, dtype, hkv, scale):
    """The whole sequence on this one GPU with the best kernel for the window (FA4 where
    installed): the reference of the issue's target, time <= 1.1 x this / N."""
    s_len, w = args.seq_len, args.window
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, do = (torch.randn(1, h, s_len, args.head_dim, generator=g).to(device, dtype)
                   for h in (args.heads, hkv, hkv, args.heads))
    task = Task(0, s_len, 0, s_len, -w, 0)
    kernel = select_kernel("auto" if args.backend == "auto" else args.backend, q, k, [task])

    def step():
        o, lse = kernel.forward(q, k, v, task.lo, task.hi, scale)
        kernel.backward(do, q, k, v, o, lse, task.lo, task.hi, scale)

    return kernel.name, step


def check_small(device, dtype, backend, heads, kv_heads, head_dim):
    """Windowed ring with `backend` vs backend='math' on the same inputs (short sequence)."""
    m = 384 if device.type == "cuda" else 24
    worst = 0.0
    for window, causal in (((700 if device.type == "cuda" else 40, 0), True), ((m // 3, m + 5), False), ((m - 1, 0), True)):
        g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
        q, k, v, do = (torch.randn(1, h, m, head_dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads))
        outs = []
        for be in (backend, "math"):
            leaf = [t.clone().requires_grad_() for t in (q, k, v)]
            o = dtcp.ring_attention(*leaf, layout=dtcp.Contiguous(), is_causal=causal, window_size=window,
                                    enable_gqa=heads != kv_heads, backend=be)
            o.backward(do)
            outs.append([o] + [t.grad for t in leaf])
        for a, b in zip(*outs):
            worst = max(worst, ((a.float() - b.float()).norm() / b.float().norm()).item())
    return max_over_ranks(worst, device)[0]


def main():
    args = parse()
    device = init_distributed(args.device)
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, args.dtype)
    hkv = args.kv_heads or args.heads
    m = args.seq_len // n
    if args.seq_len % (2 * n):
        raise SystemExit(f"--seq-len must be a multiple of 2 x world size ({2 * n}) for the zigzag comparison")
    window = (args.window, 0)
    timer = Timer(device)
    res = {"world_size": n, "seq_len": args.seq_len, "local_len": m, "heads": args.heads, "kv_heads": hkv,
           "head_dim": args.head_dim, "window": args.window, "dtype": args.dtype, "device": str(device),
           "torch": torch.__version__}

    if not args.skip_check:
        res["check_rel_err_vs_math"] = check_small(device, dtype, args.backend, args.heads, hkv, args.head_dim)

    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v, dout = (torch.randn(1, h, m, args.head_dim, generator=g).to(device, dtype)
                     for h in (args.heads, hkv, hkv, args.heads))
    leaf = [t.clone().requires_grad_() for t in (q, k, v)]
    gqa = args.heads != hkv

    def ring(layout, win):
        for t in leaf:
            t.grad = None
        o = dtcp.ring_attention(*leaf, layout=layout, is_causal=True, window_size=win, enable_gqa=gqa, backend=args.backend,
                                strategy=args.strategy)
        o.backward(dout)

    # what the windowed ring does: plan, kernel, communication
    plans = ring_plans(Contiguous(), m, n, True, AttnMask.make(True, window))
    plan = plans[rank]
    kernel = select_kernel(args.backend, q, k, [t for p in plans for s in p.steps for t in s.tasks])
    dtcp.comm_stats.reset()
    ring(dtcp.Contiguous(), window)
    st = dtcp.comm_stats  # one windowed forward + backward
    res.update(kernel=kernel.name, kv_blocks_sent_fwd_bwd=st.kv_rounds, kv_bytes_sent_fwd_bwd=st.kv_bytes_sent,
               grad_blocks_sent=st.grad_rounds, grad_bytes_sent=st.grad_bytes_sent,
               rank0_tasks=[[(t.q_start, t.q_end, t.k_start, t.k_end, t.lo, t.hi) for t in s.tasks] for s in plan.steps])
    scale = default_scale(args.head_dim)
    block = k.numel() * k.element_size() + v.numel() * v.element_size()

    times = {}
    times["windowed_ring"] = timer(lambda: ring(dtcp.Contiguous(), window), args.warmup, args.iters)
    times["local_compute"] = timer(lambda: local_compute(q, k, v, dout, plan, kernel, scale), args.warmup, args.iters)
    if not args.skip_full:
        times["full_causal_ring_zigzag"] = timer(lambda: ring(dtcp.Zigzag(), None), args.warmup, args.iters)
    if not args.skip_one_gpu:
        del leaf, q, k, v, dout  # room for the whole sequence
        res["one_gpu_kernel"], whole = one_gpu_whole_sequence(args, device, dtype, hkv, scale)
        times["one_gpu_whole_sequence"] = timer(whole, args.warmup, args.iters)
    res["ms"], res["ms_per_rank"] = {}, {}
    for key, t in times.items():
        res["ms"][key], res["ms_per_rank"][key] = max_over_ranks(t, device)
    ms = res["ms"]
    res["windowed_over_local"] = ms["windowed_ring"] / ms["local_compute"]
    if "full_causal_ring_zigzag" in ms:
        res["speedup_vs_full_causal"] = ms["full_causal_ring_zigzag"] / ms["windowed_ring"]
    if "one_gpu_whole_sequence" in ms:
        res["windowed_over_one_gpu_share"] = ms["windowed_ring"] / (ms["one_gpu_whole_sequence"] / n)

    if rank == 0:
        print(f"dtcp sliding-window ring attention: {n} ranks, {device.type}, {args.dtype}, B=1, H={args.heads}, "
              f"Hkv={hkv}, D={args.head_dim}, S={args.seq_len} (M={m}/rank), window ({args.window}, 0), kernel {kernel.name}")
        print(f"strategy {args.strategy}; rank 0, one fwd+bwd: K/V sent in {res['kv_blocks_sent_fwd_bwd']} rounds "
              f"{res['kv_bytes_sent_fwd_bwd'] / 2**20:.3f} MiB (a whole K+V block is {block / 2**20:.3f} MiB), "
              f"dK/dV in {res['grad_blocks_sent']} rounds {res['grad_bytes_sent'] / 2**20:.3f} MiB")
        if "check_rel_err_vs_math" in res:
            print(f"check vs backend='math' (short sequence): max rel err {res['check_rel_err_vs_math']:.2e}")
        print(f"{'fwd+bwd, max over ranks':<44}{'ms':>10}")
        for key, label in (("windowed_ring", "windowed ring (contiguous)"), ("local_compute", "local compute only (same kernels, no comm)"),
                           ("full_causal_ring_zigzag", "full causal ring (zigzag)"),
                           ("one_gpu_whole_sequence", f"one GPU, whole sequence ({res.get('one_gpu_kernel')})")):
            if key in ms:
                print(f"{label:<44}{ms[key]:>10.3f}")
        print(f"{'windowed / local compute (target <= 1.2)':<44}{res['windowed_over_local']:>10.3f}")
        if "speedup_vs_full_causal" in res:
            print(f"{'full causal / windowed (target >= 5)':<44}{res['speedup_vs_full_causal']:>10.2f}")
        if "windowed_over_one_gpu_share" in res:
            print(f"{'windowed / (one GPU / N) (target <= 1.1)':<44}{res['windowed_over_one_gpu_share']:>10.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
            print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
