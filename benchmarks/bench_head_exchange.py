"""The head exchange's copies (Ulysses, and hybrid's Ulysses dimension), without the transfers.

    python benchmarks/bench_head_exchange.py [--lengths 32768 131072] [--world-sizes 2 8]
    python benchmarks/bench_head_exchange.py --device cpu --lengths 1024 --world-sizes 2 4   # smoke

Per point (S tokens over U ranks, heads 32/8 of 128, bf16 on CUDA), the time of one rank's
`to_heads` of q, k, v, `to_sequence` of out and lse, and `to_sequence` of dq, dk, dv
(dtcp/exec/ulysses.py), for layouts whose gathered order takes few pieces (contiguous, zigzag) and
many (bench_strategies' `Balanced` mixes). The all-to-all stands in as a clone of the send buffer
(the bytes a transfer would write), so what is timed is the packing, the reordering and the
unpacking: what the cost model charges as the exchange's copies (device time, the launches
queued behind a GPU sleep). The inputs are token-major, as a
projection's (B, L, H, D) output transposed gives them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtcp  # noqa: E402
from bench_doc_rate import timed_ms  # noqa: E402  (device time: the launches queued behind a GPU sleep)
from dtcp.exec import ulysses as ul  # noqa: E402
from dtcp.plan.ulysses import ulysses_plan  # noqa: E402


def layouts(s: int) -> list[tuple[str, dtcp.Layout]]:
    import bench_strategies

    return [("contiguous", dtcp.Contiguous()), ("zigzag", dtcp.Zigzag()),
            ("lognormal", bench_strategies.mask_call("lognormal", s)[0]),
            ("documents", bench_strategies.mask_call("docs-balanced", s)[0])]


def point(s: int, u: int, name: str, layout, device, dtype, reps: int) -> dict:
    local = s // u
    hq, hkv, d = 32, 8, 128
    plan = ulysses_plan(layout, local, u, 1, 0, hq, hkv)
    q = torch.randn(1, local, hq, d, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, local, hkv, d, device=device, dtype=dtype).transpose(1, 2)
    q_h, k_h = ul.to_heads([(q, plan.q), (k, plan.kv)], plan, None)
    lse_h = torch.randn(1, plan.q.per_rank, u * local, 1, device=device)
    return dict(
        S=s, U=u, layout=name, pieces=len(plan.pieces),
        to_heads_qkv=timed_ms(lambda: ul.to_heads([(q, plan.q), (k, plan.kv), (k, plan.kv)], plan, None), device, reps),
        to_sequence_out_lse=timed_ms(
            lambda: ul.to_sequence([(q_h, plan.q, dtype), (lse_h, plan.q, lse_h.dtype)], plan, None), device, reps),
        to_sequence_grads=timed_ms(
            lambda: ul.to_sequence([(q_h, plan.q, dtype), (k_h, plan.kv, dtype), (k_h, plan.kv, dtype)], plan, None,
                                   sum_dtype=torch.float32), device, reps))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 8])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    saved = ul.all_to_all_bytes
    ul.all_to_all_bytes = lambda send, pg, world_size: send.clone()  # the transfer's write, not its time
    rows = []
    try:
        for s in args.lengths:
            for u in args.world_sizes:
                for name, layout in layouts(s):
                    row = point(s, u, name, layout, device, dtype, args.reps)
                    rows.append(row)
                    print(f"S={s:>7} U={u} {name:<10} pieces {row['pieces']:>4} | to_heads q,k,v "
                          f"{row['to_heads_qkv']:7.3f} ms | to_sequence out,lse {row['to_sequence_out_lse']:7.3f} ms"
                          f" | dq,dk,dv {row['to_sequence_grads']:7.3f} ms", flush=True)
    finally:
        ul.all_to_all_bytes = saved
    return rows


if __name__ == "__main__":
    main()
