"""Correctness suite for real devices (torchrun; NCCL on GPUs, gloo on CPU).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/check_correctness.py --backends flash cudnn
    torchrun --nproc-per-node 2 benchmarks/check_correctness.py --device cpu --backends cpu_flash --seq-len 512

For every backend x K/V exchange x layout x causal x heads it runs dtcp.ring_attention forward and
backward in low precision and compares out, lse, dq, dk, dv with a float64 reference on the whole
sequence. The bar: the ring's relative error is at most `--max-ratio` (1.5) times the error of the
same kernel run on one device over the whole sequence, measured on the same rows. Prints one line
per case and exits non-zero if any case fails. tests/gpu/test_gpu_suite.py runs `run_matrix`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.distributed as dist

import dtcp
from _setup import init_distributed
from dtcp.kernels import default_scale, select_kernel
from dtcp.plan import Task

KEYS = ("out", "lse", "dq", "dk", "dv")


def reference(q, k, v, dout, is_causal):
    """float64 attention, forward and backward, on the whole sequence (B, H, S, D)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * default_scale(q.shape[-1])
    if is_causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ vv
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else math.inf


def run_case(layout, is_causal, hq, hkv, backend, args, device, dtype, kv_exchange=None):
    """{key: (ring error, kernel's own error)} on this rank's rows; args: batch, seq_len, head_dim,
    kv_exchange (overridden by `kv_exchange` when given)."""
    kv_exchange = kv_exchange or args.kv_exchange
    g = torch.Generator(device="cpu").manual_seed(1234)
    shape = lambda h: (args.batch, h, args.seq_len, args.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=g).to(device, dtype) for h in (hq, hkv, hkv))
    dout = torch.randn(shape(hq), generator=g).to(device, dtype)
    ref = reference(q, k, v, dout, is_causal)
    shard = lambda t: layout.shard(t, dim=2)  # noqa: E731

    local = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=is_causal, enable_gqa=hq != hkv,
                                   backend=backend, return_lse=True, strategy=kv_exchange)
    out.backward(shard(dout))
    ring = dict(zip(KEYS, (out, lse, local[0].grad, local[1].grad, local[2].grad)))

    # the same kernel on one device over the whole sequence
    s = args.seq_len
    task = Task(0, s, 0, s, None, 0 if is_causal else None)
    kern = select_kernel(backend, q, k, [task])
    scale = default_scale(args.head_dim)
    o1, l1 = kern.forward(q, k, v, task.lo, task.hi, scale)
    d1 = kern.backward(dout, q, k, v, o1, l1, task.lo, task.hi, scale)
    single = dict(zip(KEYS, (o1, l1, *d1)))

    res = {}
    for i, key in enumerate(KEYS):
        r, kref = rel(ring[key], shard(ref[i])), rel(shard(single[key]), shard(ref[i]))
        res[key] = (r, kref)
    return res


def run_matrix(args, device, dtype, backends, exchanges, print_rows=True):
    """Every case on every rank; returns the rows (worst over ranks) and the number that failed."""
    rank = dist.get_rank()
    failures, rows = 0, []
    for backend in backends:
        for exchange in exchanges:
            for spec in args.layouts:
                layout = dtcp.layout_from_spec(spec)
                if exchange == "allgather" and spec.startswith("striped"):
                    continue  # the all-gather schedule serves one- and two-run layouts
                for is_causal in (bool(c) for c in args.causal):
                    for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads):
                        try:
                            res = run_case(layout, is_causal, hq, hkv, backend, args, device, dtype, exchange)
                            err = None
                        except Exception as e:  # reported, counted as a failure
                            res, err = {}, f"{type(e).__name__}: {e}"
                        # worst ratio over ranks for each key
                        vals = torch.tensor([[res[k][0], res[k][1]] if res else [math.inf, 1.0] for k in KEYS],
                                            dtype=torch.float64, device=device)
                        ratios = (vals[:, 0] / vals[:, 1]).clone()
                        dist.all_reduce(ratios, op=dist.ReduceOp.MAX)
                        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
                        failed = torch.tensor([0.0 if err is None else 1.0], device=device)
                        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
                        # An exchange named explicitly that the named kernel cannot serve is refused
                        # before any communication, with the reason: that is the answer, not a failure.
                        refused = exchange != "auto" and err is not None and "cannot serve this request" in err
                        ok = failed.item() == 0 and bool((ratios <= args.max_ratio).all())
                        failures += not (ok or refused)
                        row = {"backend": backend, "kv_exchange": exchange, "layout": spec, "causal": is_causal,
                               "heads": f"{hq}/{hkv}", "ring_err": dict(zip(KEYS, vals[:, 0].tolist())),
                               "kernel_err": dict(zip(KEYS, vals[:, 1].tolist())),
                               "ratio": dict(zip(KEYS, ratios.tolist())), "ok": ok, "refused": refused, "error": err}
                        rows.append(row)
                        if rank == 0 and print_rows:
                            r = row["ratio"]
                            print(f"{'PASS' if ok else 'REFUSED' if refused else 'FAIL'} {backend:9s} {exchange:9s} {spec:11s} causal={int(is_causal)} "
                                  f"heads {hq}/{hkv}  ring err out {row['ring_err']['out']:.2e} dq {row['ring_err']['dq']:.2e} "
                                  f"dk {row['ring_err']['dk']:.2e} | ratio to kernel: "
                                  + " ".join(f"{k} {r[k]:.2f}" for k in KEYS) + (f"  {err}" if err else ""), flush=True)
    return rows, failures


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "striped:1", "striped:64"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-ratio", type=float, default=1.5)
    p.add_argument("--kv-exchange", default="auto", choices=["auto", "ring", "allgather"])
    p.add_argument("--kv-exchanges", nargs="+", default=None, help="several exchanges in one run")
    p.add_argument("--json", default=None)
    p.add_argument("--causal", nargs="+", type=int, default=[1, 0], help="1 causal, 0 not")
    p.add_argument("--heads", nargs="+", default=["8/8", "8/2"], help="query/kv head pairs")
    return p.parse_args(argv)


def main():
    args = parse_args()
    device = init_distributed(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backends = args.backends or (["flash", "cudnn"] if device.type == "cuda" else ["cpu_flash"])
    exchanges = args.kv_exchanges or [args.kv_exchange]
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, failures = run_matrix(args, device, dtype, backends, exchanges)
    if rank == 0:
        print(f"{world} ranks, {device.type}, {dtype}, S={args.seq_len}, B={args.batch}, D={args.head_dim}, "
              f"kv_exchange={exchanges}: {len(rows) - failures} passed, {failures} failed")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "rows": rows}, f, indent=1)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
