"""Compare torchtitan training logs: loss per step, relative difference from a baseline, tokens/s.

    python examples/torchtitan/compare_losses.py BASE=path/to/base.log NAME=path/to/run.log ... \
        [--tol 1e-2] [--faster-than dtcp_cp2=titan_cp2 ...]

Each log is the rank-0 output of `torchrun ... -m torchtitan.train` (lines like
"step:  3  loss:  7.12345  grad_norm: ...  tps: 51,234  tflops: ..."). The first run is the
baseline. Prints one column of losses per run and, per run, the largest relative loss difference
from the baseline over the steps both logged; then the median tokens/s per device over steps 3
and later (steps 1-2 include compilation and warm-up). Exits 1 if a run differs from the
baseline by more than --tol at any step, logged fewer steps than the baseline, or if a
--faster-than pair A=B finds A's median tokens/s below B's.

Repeated runs are named NAME_r1, NAME_r2, ...: --faster-than A=B then pools the steps of every
repeat of A (and of B), prints the ratio of each repeat pair (A_ri against B_ri, run back to
back) and judges the pooled medians.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+\d.eE]+|nan|inf).*?tps:\s*([\d,]+)")


def read_log(path: str) -> dict[int, tuple[float, int]]:
    steps = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                steps[int(m.group(1))] = (float(m.group(2)), int(m.group(3).replace(",", "")))
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="NAME=LOG; the first is the baseline")
    p.add_argument("--tol", type=float, default=1e-2, help="largest relative loss difference allowed")
    p.add_argument("--faster-than", action="append", default=[], metavar="A=B",
                   help="require run A's median tokens/s >= run B's")
    args = p.parse_args()

    names, logs = [], {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"expected NAME=LOG, got {spec!r}")
        names.append(name)
        logs[name] = read_log(path)
    base = names[0]
    if not logs[base]:
        print(f"baseline {base} logged no steps", file=sys.stderr)
        return 1

    steps = sorted(set().union(*(logs[n].keys() for n in names)))
    width = max(12, *(len(n) for n in names))
    print("step  " + "  ".join(f"{n:>{width}}" for n in names))
    for s in steps:
        cells = [f"{logs[n][s][0]:>{width}.5f}" if s in logs[n] else f"{'-':>{width}}" for n in names]
        print(f"{s:>4}  " + "  ".join(cells))

    ok = True
    print(f"\nlargest relative loss difference from {base} (tolerance {args.tol:g}):")
    for n in names[1:]:
        common = [s for s in logs[base] if s in logs[n]]
        if len(common) < len(logs[base]):
            print(f"  {n:<{width}} FAIL: logged {len(logs[n])} of the baseline's {len(logs[base])} steps")
            ok = False
            continue
        diffs = [abs(logs[n][s][0] - logs[base][s][0]) / abs(logs[base][s][0]) for s in common]
        worst = max(range(len(common)), key=lambda i: diffs[i])
        verdict = "ok" if diffs[worst] <= args.tol else "FAIL"
        ok &= verdict == "ok"
        print(f"  {n:<{width}} {diffs[worst]:.2e} at step {common[worst]}  {verdict}")

    print("\nmedian tokens/s per device, steps >= 3:")
    tps = {}
    for n in names:
        vals = [t for s, (_, t) in logs[n].items() if s >= 3]
        tps[n] = statistics.median(vals) if vals else float("nan")
        print(f"  {n:<{width}} {tps[n]:>12,.0f}")
    for pair in args.faster_than:
        a, _, b = pair.partition("=")
        runs_a, runs_b = repeats_of(a, names), repeats_of(b, names)
        if not runs_a or not runs_b:
            print(f"  {pair}: FAIL, no run named {a if not runs_a else b}")
            ok = False
            continue
        if len(runs_a) > 1 or len(runs_b) > 1:
            for ra, rb in zip(runs_a, runs_b):
                print(f"  {ra} / {rb} = {tps[ra] / tps[rb]:.3f}")
        pooled_a, pooled_b = pooled_tps(logs, runs_a), pooled_tps(logs, runs_b)
        verdict = "ok" if pooled_a >= pooled_b else "FAIL"
        ok &= verdict == "ok"
        what = f" (steps >= 3 of {len(runs_a)} and {len(runs_b)} runs pooled: {pooled_a:,.0f} and {pooled_b:,.0f})" \
            if len(runs_a) > 1 or len(runs_b) > 1 else ""
        print(f"  {a} / {b} = {pooled_a / pooled_b:.3f}{what}  {verdict}")
    return 0 if ok else 1


def repeats_of(name: str, names: list[str]) -> list[str]:
    """The runs NAME or NAME_r<i>, in order."""
    return [n for n in names if n == name or re.fullmatch(re.escape(name) + r"_r\d+", n)]


def pooled_tps(logs, runs: list[str]) -> float:
    vals = [t for n in runs for s, (_, t) in logs[n].items() if s >= 3]
    return statistics.median(vals) if vals else float("nan")


if __name__ == "__main__":
    sys.exit(main())
