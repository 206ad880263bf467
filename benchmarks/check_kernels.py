"""Kernel-level check on one device: every local kernel against float64 math on band-masked blocks.

    python benchmarks/check_kernels.py --backends flash cudnn fa2 flex
    python benchmarks/check_kernels.py --backends fa4 flex --heads 32/8 --cases base softcap sinks dv varlen

For each backend, case and block (q_len, k_len, lo, hi) that the backend accepts, runs forward and
backward in bf16 and compares out, lse, dq, dk, dv with dtcp's math kernel in float64 on the same
(bf16-rounded) inputs. Blocks include lengths that are not multiples of 128 and bands that leave
some rows without keys (their out must be 0 and lse -inf, or the sink). Cases: `base` (every
block), `softcap` (30), `sinks` (per-head logits in the forward; the backward gets the final lse),
`dv` (q/k head dim 192, v head dim 128, equal head counts), each on a few blocks; `varlen` (several
sequences in one varlen call per window, against the math kernel's per-sequence loop). A backend
that is not installed is reported as MISSING and, unless --allow-missing, fails the run; a
feature or block it refuses is reported n/a with its reason. Prints each case's wall time (the
first call of a JIT-compiled kernel included). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dtcp.kernels import KERNELS, default_scale
from dtcp.kernels.base import VarlenSeqs
from dtcp.plan import Task

BLOCKS = [  # q_len, k_len, lo, hi
    (512, 512, None, None), (512, 512, None, 0), (384, 1024, None, None), (1024, 384, None, None),
    (300, 700, -200, 450), (700, 300, -500, 0), (640, 640, -100, 0), (257, 513, None, 300),
    # rows without keys: first rows (whole query tiles of them), last rows, a strictly lower band
    (1024, 256, None, -768), (700, 700, None, -300), (1000, 600, 3, 100), (1024, 1024, -1000, -1),
    (512, 2048, 1800, None),
]
FEATURE_BLOCKS = [(512, 512, None, 0), (300, 700, -200, 450), (1024, 384, None, None)]
VARLEN = {  # (q_len, k_len) of each sequence, and the bottom-right windows to run them under
    "seqs": [(300, 300), (128, 1000), (1000, 1000), (17, 33), (512, 2048), (1, 1)],
    "windows": [(-1, 0), (256, 0), (-1, -1)],
}
KEYS = ("out", "lse", "dq", "dk", "dv")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() else float("inf")


def reference(q, k, v, dout, lo, hi, scale, softcap, sink):
    """float64 math kernel; rows that see no key get out 0 (the math kernel's own 0/0 is NaN) and
    no gradient (their lse, -inf, is read as +inf in the backward, so every p is 0)."""
    math_k = KERNELS["math"]
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    ro, rl = math_k.forward(q, k, v, lo, hi, scale, softcap=softcap, sink=sink)
    ro = ro.nan_to_num(0.0)
    rd = math_k.backward(dout, q, k, v, ro, rl.masked_fill(torch.isneginf(rl), float("inf")), lo, hi, scale,
                         softcap=softcap)
    return ro, rl, rd


def check_block(kern, name, case, lq, lk, lo, hi, args, dev, tol):
    """One block: 'PASS'/'FAIL'/'n/a'/'MISSING' and the line printed."""
    hq, hkv = (int(x) for x in case["heads"].split("/"))
    d, dv = case["head_dim"], case["value_head_dim"]
    scale = default_scale(d)
    task = Task(0, lq, 0, lk, lo, hi)
    g = torch.Generator().manual_seed(lq * 7 + lk)
    q = torch.randn(2, hq, lq, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(2, hkv, lk, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(2, hkv, lk, dv, generator=g).to(dev, torch.bfloat16)
    dout = torch.randn(2, hq, lq, dv, generator=g).to(dev, torch.bfloat16)
    sink = (torch.randn(hq, generator=g) * 2).to(dev, torch.float32) if case["sinks"] else None
    softcap = case["softcap"]
    where = f"{name:6s} {case['name']:7s} {lq}x{lk} band ({lo}, {hi})"
    why = kern.feature_reason(q, v, softcap, sink is not None) or kern.reject_reason(q, k, [task])
    if why is not None:
        return ("MISSING" if "not installed" in why else "n/a"), f"{where}: {why}"
    ro, rl, rd = reference(q, k, v, dout, lo, hi, scale, softcap, sink)
    o, l = kern.forward(q, k, v, lo, hi, scale, softcap=softcap, sink=sink)
    dd = kern.backward(dout, q, k, v, o, l, lo, hi, scale, softcap=softcap)
    seen = torch.isfinite(rl)  # rows with at least one key or a sink (lse of the others is -inf)
    errs = {"out": rel(o, ro), "lse": rel(l.double()[seen], rl[seen]),
            **{key: rel(a, b) for key, a, b in zip(KEYS[2:], dd, rd)}}
    lse_ok = bool(torch.isneginf(l[~seen]).all())  # rows without keys: lse -inf, as the reference
    ok = lse_ok and all(e <= tol for e in errs.values())
    return ("PASS" if ok else "FAIL"), (f"{where}: " + " ".join(f"{key} {e:.1e}" for key, e in errs.items())
                                        + ("" if lse_ok else "  (rows without keys: lse not -inf)"))


def _seqs(lens, dev) -> VarlenSeqs:
    cu_q, cu_k = [0], [0]
    for a, b in lens:
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    return VarlenSeqs(tuple(cu_q), tuple(cu_k), torch.tensor(cu_q, dtype=torch.int32, device=dev),
                      torch.tensor(cu_k, dtype=torch.int32, device=dev), max(a for a, _ in lens),
                      max(b for _, b in lens))


def check_varlen(kern, name, window, args, dev, tol, heads):
    hq, hkv = (int(x) for x in heads.split("/"))
    d = args.head_dim
    lens = VARLEN["seqs"]
    where = f"{name:6s} varlen  {len(lens)} seqs window {window}"
    if not kern.supports_varlen:
        return "n/a", f"{where}: {name} takes no varlen calls"
    q0 = torch.empty(1, hq, 1, d, device=dev, dtype=torch.bfloat16)
    why = kern.reject_reason(q0, q0[:, :hkv], []) or kern.reject_varlen_reason(lens, window)
    if why is not None:
        return ("MISSING" if "not installed" in why else "n/a"), f"{where}: {why}"
    seqs = _seqs(lens, dev)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(seqs.cu_q[-1], hq, d, generator=g).to(dev, torch.bfloat16)
    k, v = (torch.randn(seqs.cu_k[-1], hkv, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    dout = torch.randn(seqs.cu_q[-1], hq, d, generator=g).to(dev, torch.bfloat16)
    scale = default_scale(d)
    math_k = KERNELS["math"]
    ro, rl = math_k.varlen_forward(q.double(), k.double(), v.double(), seqs, window, scale)
    rd = math_k.varlen_backward(dout.double(), q.double(), k.double(), v.double(), ro, rl, seqs, window, scale)
    o, l = kern.varlen_forward(q, k, v, seqs, window, scale)
    dd = kern.varlen_backward(dout, q, k, v, o, l, seqs, window, scale)
    errs = {"out": rel(o, ro), "lse": rel(l, rl), **{key: rel(a, b) for key, a, b in zip(KEYS[2:], dd, rd)}}
    ok = all(e <= tol for e in errs.values())
    return ("PASS" if ok else "FAIL"), f"{where}: " + " ".join(f"{key} {e:.1e}" for key, e in errs.items())


def fa4_untrimmed(args, dev):
    """Diagnostic, not a check: FA4 on the blocks with rows that see no key WITHOUT dtcp's
    sub-block (fa4_call): FA4's own window over the whole block. Shows what the sub-block avoids."""
    from dtcp.kernels.fa4 import Fa4Call, _interface, fa4_call

    kern, fa = KERNELS["fa4"], _interface()
    hq, hkv = (int(x) for x in args.heads[0].split("/"))
    d = args.head_dim
    for lq, lk, lo, hi in BLOCKS:
        if fa4_call(lq, lk, lo, hi).whole(lq, lk):
            continue
        shift = lk - lq
        raw = Fa4Call(0, lq, 0, lk, None if lo is None else shift - lo, None if hi is None else hi - shift)
        g = torch.Generator().manual_seed(lq * 7 + lk)
        q = torch.randn(2, hq, lq, d, generator=g).to(dev, torch.bfloat16)
        k, v = (torch.randn(2, hkv, lk, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        ro, rl, _ = reference(q, k, v, torch.zeros_like(q), lo, hi, default_scale(d), None, None)
        try:
            o, l = kern._forward_call(fa, q, k, v, raw, default_scale(d), None, None)
            seen = torch.isfinite(rl)
            keyless = o.double()[:, :, ~seen[0, 0]].abs().max().item() if (~seen).any() else 0.0
            print(f"diag   fa4 untrimmed {lq}x{lk} band ({lo}, {hi}) as FA4 window ({raw.left}, {raw.right}): "
                  f"out err {rel(o, ro):.1e}, lse err (rows with keys) {rel(l.double()[seen], rl[seen]):.1e}, "
                  f"rows without keys: max |out| {keyless:.2e}, "
                  f"lse -inf: {bool(torch.isneginf(l[~seen]).all())}", flush=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic
            print(f"diag   fa4 untrimmed {lq}x{lk} band ({lo}, {hi}): raised {type(e).__name__}: {str(e)[:200]}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["flash", "cudnn", "fa2", "flex"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", nargs="+", default=["8/2"], help="query/kv head pairs of the base case")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cases", nargs="+", default=["base"], choices=["base", "softcap", "sinks", "dv", "varlen"])
    p.add_argument("--tol", type=float, default=2e-2, help="relative error bound (bf16 inputs, fp32 accumulation)")
    p.add_argument("--allow-missing", action="store_true")
    p.add_argument("--fa4-untrimmed", action="store_true", help="diagnostic: FA4 on blocks with keyless rows, "
                   "without dtcp's sub-block")
    args = p.parse_args()
    dev = torch.device(args.device)
    failures = 0
    counts = {}
    for name in args.backends:
        kern = KERNELS[name]
        missing = False
        for case_name in args.cases:
            t0 = time.perf_counter()
            if case_name == "varlen":
                lines = []
                for w in VARLEN["windows"]:
                    try:
                        lines.append(check_varlen(kern, name, w, args, dev, args.tol, args.heads[0]))
                    except Exception as e:  # noqa: BLE001 - reported, counted as a failure
                        lines.append(("FAIL", f"{name:6s} varlen  window {w}: raised {type(e).__name__}: {e}"))
            else:
                cases = ([dict(heads=h) for h in args.heads] if case_name == "base" else
                         [dict(heads=args.heads[0], softcap=30.0)] if case_name == "softcap" else
                         [dict(heads=args.heads[0], sinks=True)] if case_name == "sinks" else
                         [dict(heads="8/8", head_dim=192, value_head_dim=128)])
                lines = []
                for c in cases:
                    case = dict(name=case_name, heads=c["heads"], head_dim=c.get("head_dim", args.head_dim),
                                value_head_dim=c.get("value_head_dim", c.get("head_dim", args.head_dim)),
                                softcap=c.get("softcap"), sinks=c.get("sinks", False))
                    for block in (BLOCKS if case_name == "base" else FEATURE_BLOCKS):
                        try:
                            status, line = check_block(kern, name, case, *block, args, dev, args.tol)
                        except Exception as e:  # noqa: BLE001 - reported, counted as a failure
                            status, line = "FAIL", f"{name:6s} {case_name:7s} {block}: raised {type(e).__name__}: {e}"
                        lines.append((status, line))
                        print(f"{status:7s} {line}", flush=True)
                        if status == "MISSING":
                            break
            if case_name == "varlen":
                for status, line in lines:
                    print(f"{status:7s} {line}", flush=True)
            for status, _ in lines:
                counts[status] = counts.get(status, 0) + 1
                failures += status == "FAIL" or (status == "MISSING" and not args.allow_missing)
            print(f"        {name} {case_name}: {time.perf_counter() - t0:.1f} s", flush=True)
            if any(s == "MISSING" for s, _ in lines):
                missing = True
                break
        if name == "fa4" and args.fa4_untrimmed and not missing:
            fa4_untrimmed(args, dev)
    print(f"{failures} failure(s); " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
