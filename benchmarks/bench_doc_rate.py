"""The kernel's rate on short documents: T tokens packed as causal documents of c tokens each,
one varlen launch forward and one backward (dtcp's kernel interface: FA4 on Hopper), against one
T-token causal document. Pairs per ms relative to that document's: what a launch made of short
documents (a `Balanced` rank's whole short documents, its cut chunks' diagonal blocks) loses to
the kernel's cost per tile, apart from anything dtcp does around it.

    python benchmarks/bench_doc_rate.py --tokens 32768 131072 --json out.json

On CUDA each pass is queued behind a sleep and timed with events over `--reps` runs (the host
hidden); on CPU (`--device cpu`, a smoke run) with the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_split as B  # noqa: E402
from dtcp.kernels import KERNELS, VarlenSeqs, default_scale  # noqa: E402

DOC_LENS = (16384, 8192, 4096, 2048, 1024, 512, 256, 128)


def seqs_of(total: int, doc_len: int, device) -> VarlenSeqs:
    cu = tuple(range(0, total + 1, doc_len))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return VarlenSeqs(cu, cu, cu_t, cu_t, doc_len, doc_len)


def timed_ms(fn, device, reps: int) -> float:
    fn()  # (compiles, warms up)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(30 * B.sleep_cycles_per_ms()))  # the launches queue behind it: host hidden
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure(total: int, hq: int, hkv: int, d: int, kernel_name: str, device, dtype, reps: int) -> list[dict]:
    kernel = KERNELS[kernel_name]
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(total, hq, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(total, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    scale, causal = default_scale(d), (-1, 0)
    rows, base = [], None
    for doc_len in (total,) + tuple(c for c in DOC_LENS if c < total):
        if total % doc_len:
            continue
        seqs = seqs_of(total, doc_len, device)
        out, lse = kernel.varlen_forward(q, k, v, seqs, causal, scale)
        fwd = timed_ms(lambda: kernel.varlen_forward(q, k, v, seqs, causal, scale), device, reps)
        bwd = timed_ms(lambda: kernel.varlen_backward(dout, q, k, v, out, lse, seqs, causal, scale), device, reps)
        pairs = (total // doc_len) * doc_len * (doc_len + 1) // 2
        rate = pairs / (fwd + bwd)
        base = base or rate
        rows.append(dict(tokens=total, doc_len=doc_len, docs=total // doc_len, fwd_ms=fwd, bwd_ms=bwd,
                         pairs=pairs, relative_rate=rate / base))
        print(f"T={total:7d} c={doc_len:6d} docs={total // doc_len:5d}  fwd {fwd:8.3f} ms  bwd {bwd:8.3f} ms  "
              f"rate vs one document {rate / base:.3f}", flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default=None, help="dtcp kernel name (default: fa4 on cuda, math on cpu)")
    p.add_argument("--tokens", nargs="*", type=int, default=[32768, 131072])
    p.add_argument("--heads", default="32/8", help="Hq/Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for the smoke run)")
    backend = args.backend or ("fa4" if device.type == "cuda" else "math")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv = (int(x) for x in args.heads.split("/"))
    rows = []
    for total in args.tokens:
        rows += measure(total, hq, hkv, args.head_dim, backend, device, dtype, args.reps)
    result = dict(meta=dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                            torch=torch.__version__, backend=backend, dtype=str(dtype), heads=args.heads,
                            head_dim=args.head_dim, reps=args.reps), points=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
