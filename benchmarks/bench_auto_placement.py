"""What layout="auto" places a packed batch for, by the cost model: the ring's placement or the
one balancing the work alone (dtcp.api.placed_for_the_fastest_strategy), over bench_split's
long-tailed batches, and what the choice costs the host per new batch. No GPU: the cost model's
predictions for calls on CUDA (meta tensors), the placements' work from the plans.

For each batch (Pareto and log-normal mixes, seeds, lengths, N), with dtcp.config.auto_placement
= "fastest" and attention_heads = --heads:

  ring imb   the busiest rank's causal work over the mean's in Balanced's placement for the ring
  work imb   the same in the work-balanced placement (Balanced(min_chunk=256, hidden_steps=N))
  ring pick  the strategy auto picks on the ring's placement, and its predicted fwd+bwd ms
  work pick  the same on the work-balanced placement (only where the ring's is unbalanced: it is
             weighed only above 1.05x)
  chosen     what resolve_auto returns
  host ms    resolve_auto's time for this batch and the placement's search that sharding with it
             makes, with the choice and without (auto_placement "ring"), each the best of --reps,
             placements' caches cleared before each

    python benchmarks/bench_auto_placement.py                       # 32/8 heads of 128, N = 2-16
    python benchmarks/bench_auto_placement.py --heads 32,32,128 --world-sizes 8 16 --lengths 131072
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_split as B  # noqa: E402
import dtcp  # noqa: E402
from dtcp.api import WORK_IMBALANCE, _predicted_call_s, resolve_auto, work_balanced  # noqa: E402
from dtcp.layouts.balanced import _placement  # noqa: E402


def _imbalance(layout: dtcp.Balanced, n: int) -> float:
    work = layout.rank_work(n)
    return max(work) / (sum(work) / n) if sum(work) else 1.0


def _host_ms(cu: torch.Tensor, s: int, n: int, heads, reps: int) -> float:
    """resolve_auto's time, and the placement's search that sharding with its result makes (without
    the choice, that is where the search runs), the best of `reps`."""
    best = float("inf")
    for _ in range(reps):
        _placement.cache_clear()
        with dtcp.config.override(attention_heads=heads, auto_placement="fastest" if heads else "ring"):
            t0 = time.perf_counter()
            layout = resolve_auto(dtcp.Auto(), cu, s, n)
            layout.rank_work(n)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def point(mix: str, seed: int, s: int, n: int, heads, reps: int) -> dict:
    docs = B.pad_last((B.pareto_docs if mix == "pareto" else B.lognormal_docs)(s, seed, 1.0), n)
    cu = torch.tensor([0] + list(itertools.accumulate(docs)), dtype=torch.int32)
    ring = dtcp.Balanced(docs)
    with dtcp.config.override(attention_heads=heads, auto_placement="fastest"):
        chosen = resolve_auto(dtcp.Auto(), cu, s, n)
        ring_s = _predicted_call_s(ring, n, 1, "auto")
        rec = dict(mix=mix, seed=seed, seq_len=s, world_size=n, documents=len(docs), ring_imbalance=_imbalance(ring, n),
                   ring_ms=ring_s * 1e3, chosen=chosen.op_spec())
        if rec["ring_imbalance"] > 1 + WORK_IMBALANCE:
            work = work_balanced(ring, n)
            rec.update(work_imbalance=_imbalance(work, n), work_ms=_predicted_call_s(work, n, 1, "auto") * 1e3)
    rec["host_ms"] = _host_ms(cu, s, n, heads, reps)
    rec["host_ms_without"] = _host_ms(cu, s, n, None, reps)
    return rec


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,8,128", help="dtcp.config.attention_heads: q heads, kv heads, head dim")
    p.add_argument("--mixes", nargs="*", default=["pareto", "lognormal"])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--lengths", nargs="*", type=int, default=[32768, 131072, 524288])
    p.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=2, help="host time: the best of this many resolves")
    p.add_argument("--out", default=None, help="write the points as JSON here")
    args = p.parse_args(argv)
    heads = tuple(int(x) for x in args.heads.split(","))
    points = []
    print(f"{'mix':<10} {'seed':>4} {'S':>7} {'N':>3} {'docs':>5} {'ring imb':>8} {'work imb':>8} "
          f"{'ring pick ms':>12} {'work pick ms':>12}  {'chosen':<18} {'host ms (without)':>18}")
    with dtcp.config.override(cost_objective="call"):
        for mix, seed, s, n in itertools.product(args.mixes, args.seeds, args.lengths, args.world_sizes):
            rec = point(mix, seed, s, n, heads, args.reps)
            points.append(rec)
            work_imb = f"{rec['work_imbalance']:.3f}" if "work_ms" in rec else "-"
            work_ms = f"{rec['work_ms']:.2f}" if "work_ms" in rec else "-"
            print(f"{mix:<10} {seed:>4} {s:>7} {n:>3} {rec['documents']:>5} {rec['ring_imbalance']:>8.3f} "
                  f"{work_imb:>8} {rec['ring_ms']:>12.2f} {work_ms:>12}  {rec['chosen']:<18} "
                  f"{rec['host_ms']:>8.1f} ({rec['host_ms_without']:.1f})")
    weighed = [r for r in points if "work_ms" in r]
    taken = [r for r in points if r["chosen"] != "balanced"]
    extra = [r["host_ms"] - r["host_ms_without"] for r in points]
    summary = dict(points=len(points), weighed=len(weighed), taken=len(taken),
                   predicted_gain=[1 - r["work_ms"] / r["ring_ms"] for r in taken],
                   host_ms_added_median=statistics.median(extra), host_ms_added_max=max(extra),
                   host_ms_added_median_weighed=statistics.median([r["host_ms"] - r["host_ms_without"]
                                                                   for r in weighed]) if weighed else 0.0)
    print(f"\n{len(points)} batches: the work-balanced placement weighed at {len(weighed)} (ring placement above "
          f"{1 + WORK_IMBALANCE:.2f}x the mean's work), taken at {len(taken)}"
          + (f" (predicted {min(summary['predicted_gain']):.0%}-{max(summary['predicted_gain']):.0%} faster)"
             if taken else ""))
    print(f"host time the choice adds per new batch: median {summary['host_ms_added_median']:.1f} ms, "
          f"where weighed {summary['host_ms_added_median_weighed']:.1f} ms, worst {summary['host_ms_added_max']:.1f} ms")
    result = dict(heads=list(heads), points=points, summary=summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
