"""Kernel-level check on one device: every local kernel against float64 math on band-masked blocks.

    python benchmarks/check_kernels.py --backends flash cudnn fa2 flex

For each backend and each block (q_len, k_len, lo, hi) that the backend accepts, runs forward and
backward in bf16 and compares out, lse, dq, dk, dv with dtcp's math kernel in float64 on the same
(bf16-rounded) inputs. Blocks include lengths that are not multiples of 128 and bands that leave
some rows without keys. A backend that is not installed is reported as MISSING and, unless
--allow-missing, fails the run. Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dtcp.kernels import KERNELS, default_scale
from dtcp.plan import Task

BLOCKS = [  # q_len, k_len, lo, hi
    (512, 512, None, None), (512, 512, None, 0), (384, 1024, None, None), (1024, 384, None, None),
    (300, 700, -200, 450), (700, 300, -500, 0), (640, 640, -100, 0), (257, 513, None, 300),
]
KEYS = ("out", "lse", "dq", "dk", "dv")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() else float("inf")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["flash", "cudnn", "fa2", "flex"])
    p.add_argument("--heads", default="8/2")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tol", type=float, default=2e-2, help="relative error bound (bf16 inputs, fp32 accumulation)")
    p.add_argument("--allow-missing", action="store_true")
    args = p.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    dev, d = torch.device("cuda"), args.head_dim
    scale = default_scale(d)
    math_k = KERNELS["math"]
    failures = 0
    for name in args.backends:
        kern = KERNELS[name]
        for lq, lk, lo, hi in BLOCKS:
            task = Task(0, lq, 0, lk, lo, hi)
            g = torch.Generator().manual_seed(lq * 7 + lk)
            q = torch.randn(2, hq, lq, d, generator=g).to(dev, torch.bfloat16)
            k, v = (torch.randn(2, hkv, lk, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
            dout = torch.randn(2, hq, lq, d, generator=g).to(dev, torch.bfloat16)
            why = kern.reject_reason(q, k, [task])
            if why is not None:
                missing = "not installed" in why
                failures += missing and not args.allow_missing
                print(f"{'MISSING' if missing else 'n/a    '} {name:6s} {lq}x{lk} band ({lo}, {hi}): {why}")
                if missing:
                    break
                continue
            ro, rl = math_k.forward(q.double(), k.double(), v.double(), lo, hi, scale)
            rd = math_k.backward(dout.double(), q.double(), k.double(), v.double(), ro, rl, lo, hi, scale)
            o, l = kern.forward(q, k, v, lo, hi, scale)
            dd = kern.backward(dout, q, k, v, o, l, lo, hi, scale)
            seen = torch.isfinite(rl)  # rows with at least one key (lse of the others is -inf)
            errs = {"out": rel(o, ro), "lse": rel(l.double()[seen], rl[seen]),
                    **{key: rel(a, b) for key, a, b in zip(KEYS[2:], dd, rd)}}
            ok = all(e <= args.tol for e in errs.values())
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'}    {name:6s} {lq}x{lk} band ({lo}, {hi}): "
                  + " ".join(f"{key} {e:.1e}" for key, e in errs.items()), flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
