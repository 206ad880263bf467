"""Context-parallel attention benchmark: dtcp against the ideal and PyTorch's native CP, in one run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/bench_attention.py \
        --seq-lens 32768 131072 --out bench_out
    torchrun --nproc-per-node 2 benchmarks/bench_attention.py --device cpu --seq-lens 512 --heads 4 --head-dim 32

For each total sequence length S and configuration it times forward and forward+backward of
  one-gpu     one GPU running the best local kernel over the whole sequence, no context
              parallelism at all (backend="auto"'s choice for it: FlashAttention-4 where installed,
              else cuDNN), every rank at once; the reference for the "of one GPU" ratios;
  ideal       the same local kernels on this rank's blocks, with the same merges, and no
              communication (dtcp's ring with a no-op communicator);
  dtcp        dtcp.ring_attention (eager, and inside torch.compile), with each --kv-exchange
              (auto, ring, allgather; named dtcp-<layout> for auto, dtcp-<layout>-<exchange> else);
  torch-cp    PyTorch's torch.distributed.tensor.experimental.context_parallel with the same
              kernel, rotate method allgather and alltoall (CUDA only);
and reports ms, TFLOPs per GPU (causal fwd FLOPs = 2*B*H*S^2*D / N, fwd+bwd = 3.5x that; N = 1
for one-gpu), the ratios to one GPU's best kernel, to the ideal and to the best torch-cp, peak
memory per GPU and K/V bytes sent per ring step. Times are CUDA-event means after warm-up, max over ranks. Writes results.json and
tflops.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtcp
from _setup import init_distributed
from dtcp.comm.p2p import NoComm
from dtcp.exec.ring import ring_backward, ring_forward
from dtcp.exec.route import CallArgs, route_for
from dtcp.kernels import default_scale, select_kernel
from dtcp.plan import Task


def flops(b, h, s, d, causal, world, with_bwd):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) / world
    return f * (3.5 if with_bwd else 1.0)


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn, warmup, iters):
        for _ in range(warmup):
            fn()
        self.sync()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / iters
        t = torch.tensor([ms], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def peak_mem_gib(device):
    if device.type != "cuda":
        return float("nan")
    t = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reset_mem(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_dtcp(args, s, hkv, layout, backend, device, dtype, timer, mode, kv_exchange="auto"):
    world = dist.get_world_size()
    local = s // world
    q = torch.randn(args.batch, args.heads, local, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(args.batch, hkv, local, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    gqa = hkv != args.heads

    if mode == "ideal":
        scale = default_scale(args.head_dim)
        call = CallArgs(dist.group.WORLD.group_name, layout.spec(), True, scale, backend, -1, -1, "ring")
        route = route_for(q, k, v, call, None, "benchmark ideal")
        plan, kernel = route.plan, route.kernel
        nocomm = NoComm()

        def fwd():
            return ring_forward(q.detach(), k.detach(), v.detach(), plan, kernel, scale, nocomm)

        def fwd_bwd():
            out, lse = fwd()
            return ring_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, plan, kernel, scale, nocomm)
    else:
        def attn(q, k, v):
            return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=gqa, backend=backend,
                                       strategy=kv_exchange)

        if mode == "compile":
            attn = torch.compile(attn, fullgraph=True)

        def fwd():
            with torch.no_grad():
                return attn(q, k, v)

        def fwd_bwd():
            out = attn(q, k, v)
            out.backward(dout)

    reset_mem(device)
    t_fwd = timer(fwd, args.warmup, args.iters)
    t_all = timer(fwd_bwd, args.warmup, args.iters)
    mem = peak_mem_gib(device)
    if args.profile and mode == "eager" and device.type == "cuda":
        for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            nccl_ms, share, comp_ms = profile_overlap(fn)
            t = torch.tensor([share], device=device, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            if dist.get_rank() == 0:
                print(f"  profile S={s} kv={hkv} {what}: comm (NCCL kernels + memcpys) {nccl_ms:.2f} ms/iter, compute kernels {comp_ms:.2f} ms/iter; "
                      f"share of comm time concurrent with compute (min over ranks): {t.item():.1%}", flush=True)
    return t_fwd, t_all, mem


def bench_one_gpu(args, s, hkv, device, dtype, timer):
    """One GPU, the whole sequence, the best local kernel for it (backend="auto"'s choice:
    FlashAttention-4 where installed, else cuDNN), through dtcp's kernel interface (the kernels'
    own forward and backward, nothing else). Every rank runs it on its own GPU at once."""
    q = torch.randn(args.batch, args.heads, s, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, hkv, s, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    task = Task(0, s, 0, s, None, 0)  # causal
    kernel = select_kernel("auto", q, k, [task])
    scale = default_scale(args.head_dim)

    def fwd():
        return kernel.forward(q, k, v, None, 0, scale)

    def fwd_bwd():
        out, lse = fwd()
        return kernel.backward(dout, q, k, v, out, lse, None, 0, scale)

    reset_mem(device)
    t_fwd = timer(fwd, args.warmup, args.iters)
    t_all = timer(fwd_bwd, args.warmup, args.iters)
    return kernel.name, t_fwd, t_all, peak_mem_gib(device)


def bench_torch_cp(args, s, hkv, backend, device, dtype, timer, rotate):
    """PyTorch's native context parallel (head-tail layout) with the same SDPA kernel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # "auto": cuDNN, which SDPA itself prefers on H200 (and torchtitan's CP runs there). "fa4":
    # cuDNN too, torch CP's fastest kernel (SDPA's FA4 route fails on torch 2.11 with flash-attn-4
    # 4.0.0b36: its _flash_attn_fwd returns 5 values, torch unpacks 2).
    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                    "auto": SDPBackend.CUDNN_ATTENTION, "fa4": SDPBackend.CUDNN_ATTENTION}[backend]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    set_rotate_method(rotate)
    q = torch.randn(args.batch, args.heads, s, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, hkv, s, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    bufs = [q, k, v, dout]
    reset_mem(device)
    # Buffers must not require grad when the block exits (PyTorch restores them by resizing),
    # so grads go on detached views and the buffers are not restored.
    with sdpa_kernel(sdpa_backend), context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                                                     no_restore_buffers=set(bufs)):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=hkv != args.heads)

        def fwd_bwd():
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=hkv != args.heads)
            out.backward(dout)

        t_fwd = timer(fwd, args.warmup, args.iters)
        t_all = timer(fwd_bwd, args.warmup, args.iters)
    return t_fwd, t_all, peak_mem_gib(device)


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(xs, ys):
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def profile_overlap(fn, steps=2):
    """Run fn under the profiler; return (communication ms: NCCL kernels and copy-engine
    memcpys, share of it concurrent with other kernels, compute kernel ms) for this rank."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    nccl, comp = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        (nccl if ("nccl" in name or "memcpy" in name) else comp).append(iv)
    nccl, comp = _union(nccl), _union(comp)
    nccl_us = sum(b - a for a, b in nccl)
    return nccl_us / 1e3 / steps, (_overlap(nccl, comp) / nccl_us if nccl_us else float("nan")), sum(b - a for a, b in comp) / 1e3 / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, nargs="+", default=None, help="default: heads (MHA); add 8 for GQA")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["zigzag"])
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--modes", nargs="+", default=["eager", "compile"])
    p.add_argument("--kv-exchange", nargs="+", default=["auto"], choices=["auto", "ring", "allgather"])
    p.add_argument("--torch-cp", nargs="*", default=["allgather", "alltoall"], help="rotate methods; empty to skip")
    p.add_argument("--torch-cp-max-seq", type=int, default=262144)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--profile", action="store_true", help="measure NCCL/compute kernel overlap of dtcp fwd+bwd")
    p.add_argument("--no-one-gpu", action="store_true", help="skip the one-GPU whole-sequence reference")
    args = p.parse_args()

    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or (["cudnn"] if device.type == "cuda" else ["cpu_flash"])
    kv_heads = args.kv_heads or [args.heads]
    timer = Timer(device)
    rows = []

    def report(system, s, hkv, backend, layout_name, mode, t_fwd, t_all, mem, kv_bytes, gpus=world):
        fl_f = flops(args.batch, args.heads, s, args.head_dim, True, gpus, False)
        fl_a = flops(args.batch, args.heads, s, args.head_dim, True, gpus, True)
        row = dict(system=system, seq_len=s, kv_heads=hkv, backend=backend, layout=layout_name, mode=mode,
                   fwd_ms=t_fwd, fwd_bwd_ms=t_all, fwd_tflops=fl_f / t_fwd / 1e9, fwd_bwd_tflops=fl_a / t_all / 1e9,
                   peak_mem_gib=mem, kv_bytes_per_step=kv_bytes)
        rows.append(row)
        if rank == 0:
            print(f"S={s:>8} kv={hkv:>2} {backend:6s} {system:22s} {mode:8s} fwd {t_fwd:9.2f} ms {row['fwd_tflops']:6.1f} TF | "
                  f"fwd+bwd {t_all:9.2f} ms {row['fwd_bwd_tflops']:6.1f} TF | peak {mem:6.2f} GiB", flush=True)

    for s in args.seq_lens:
        for hkv in kv_heads:
            if not args.no_one_gpu:
                try:
                    name, *r = bench_one_gpu(args, s, hkv, device, dtype, timer)
                    report("one-gpu", s, hkv, name, "whole", "kernel", *r, 0, gpus=1)
                except Exception as e:
                    if rank == 0:
                        print(f"S={s} one-gpu: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                reset_mem(device)
            for backend in backends:
                kv_bytes = 2 * args.batch * hkv * (s // world) * args.head_dim * torch.finfo(dtype).bits // 8
                for layout_name in args.layouts:
                    layout = dtcp.layout_from_spec(layout_name)
                    runs = [("ideal", "ring")] + [(m, x) for m in args.modes for x in args.kv_exchange]
                    for mode, exchange in runs:
                        system = "ideal" if mode == "ideal" else f"dtcp-{layout_name}" + ("" if exchange == "auto" else f"-{exchange}")
                        try:
                            r = bench_dtcp(args, s, hkv, layout, backend, device, dtype, timer, mode, exchange)
                            report(system, s, hkv, backend, layout_name, mode, *r, 0 if mode == "ideal" else kv_bytes)
                        except Exception as e:
                            if rank == 0:
                                print(f"S={s} {system} {mode}: FAILED {type(e).__name__}: {e}", flush=True)
                if device.type == "cuda" and s <= args.torch_cp_max_seq:
                    for rotate in args.torch_cp:
                        try:
                            r = bench_torch_cp(args, s, hkv, backend, device, dtype, timer, rotate)
                            report(f"torch-cp-{rotate}", s, hkv, backend, "head-tail", "eager", *r, kv_bytes)
                        except Exception as e:
                            if rank == 0:
                                print(f"S={s} torch-cp {rotate}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    if rank == 0:
        summarize(rows)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"world": world, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)
        plot(rows, os.path.join(args.out, "tflops.png"), world)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


def summarize(rows):
    print("\nsummary (fwd+bwd TFLOPs per GPU; ratio to one GPU running the best kernel over the whole sequence "
          "(one-gpu, fwd ratio in brackets); ratio to ideal; ratio to best torch-cp with the same backend "
          "(cuDNN for fa4)):")
    for r in rows:
        if r["system"].startswith("torch-cp"):
            continue
        size = lambda x: x["seq_len"] == r["seq_len"] and x["kv_heads"] == r["kv_heads"]  # noqa: E731
        same = lambda x: size(x) and x["backend"] == r["backend"]  # noqa: E731
        if r["system"] == "one-gpu":
            print(f"  S={r['seq_len']:>8} kv={r['kv_heads']:>2} {r['backend']:6s} {'one-gpu':16s} {'kernel':8s} "
                  f"{r['fwd_bwd_tflops']:6.1f} TF  (fwd {r['fwd_tflops']:.1f} TF): the reference")
            continue
        one = [x for x in rows if size(x) and x["system"] == "one-gpu"]
        ideal = [x for x in rows if same(x) and x["system"] == "ideal" and x["layout"] == r["layout"]]
        native = [x for x in rows if same(x) and x["system"].startswith("torch-cp")]
        vs_one = r["fwd_bwd_tflops"] / one[0]["fwd_bwd_tflops"] if one else float("nan")
        fwd_one = r["fwd_tflops"] / one[0]["fwd_tflops"] if one else float("nan")
        vs_ideal = r["fwd_bwd_tflops"] / ideal[0]["fwd_bwd_tflops"] if ideal else float("nan")
        vs_native = r["fwd_bwd_tflops"] / max(x["fwd_bwd_tflops"] for x in native) if native else float("nan")
        fwd_ideal = r["fwd_tflops"] / ideal[0]["fwd_tflops"] if ideal else float("nan")
        line = (f"  S={r['seq_len']:>8} kv={r['kv_heads']:>2} {r['backend']:6s} {r['system']:16s} {r['mode']:8s} "
                f"{r['fwd_bwd_tflops']:6.1f} TF  x{vs_one:.3f} of one-gpu {one[0]['backend'] if one else '-'} "
                f"(fwd x{fwd_one:.3f})")
        if r["system"] != "ideal":
            line += f"  x{vs_ideal:.3f} of ideal (fwd x{fwd_ideal:.3f})  x{vs_native:.3f} of torch-cp"
        print(line)


def plot(rows, path, world):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = sorted({(r["system"], r["mode"], r["backend"], r["kv_heads"]) for r in rows})
    for key in systems:
        pts = sorted((r["seq_len"], r["fwd_bwd_tflops"]) for r in rows if (r["system"], r["mode"], r["backend"], r["kv_heads"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]} {key[2]} kv{key[3]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total sequence length")
    ax.set_ylabel("fwd+bwd TFLOPs per GPU")
    ax.set_title(f"causal attention, {world} ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
