"""The cost model beyond one host, on paper: predicted attention time per layer (forward + backward)
and the best strategy for 8 to 256 GPUs at 128K to 4M tokens. A model, not a measurement: the
constants are dtcp.plan.MACHINES' (H200 on NVLink inside a node of 8, 400 Gb/s InfiniBand per GPU
between nodes). Prints the markdown table of docs/scaling.md.

    python benchmarks/model_scaling.py

Workload: B=1, 32 query / 8 key-value heads, D=128, bf16, causal, zigzag (balanced), one layer.
Strategies: "ring" and "allgather" over all N ranks (their slowest link is InfiniBand once N > 8),
"ulysses" over all N (only where 32 query heads split over N), and "hybrid": Ulysses over the 8
GPUs of a node (NVLink) x the ring across N / 8 nodes (InfiniBand).
"""

from __future__ import annotations

from dtcp.plan import MACHINES, CallShape, predict

NODE = 8
HQ, HKV, D = 32, 8, 128


def shape(s: int, n: int) -> CallShape:
    local = s // n
    total_pairs = s * (s + 1) / 2
    hybrid_r = max(1, n // NODE)
    return CallShape(
        batch=1, q_heads=HQ, kv_heads=HKV, head_dim=D, v_head_dim=D, elem_bytes=2, world_size=n, local_len=local,
        ring_pairs=total_pairs / n, ring_rounds=n - 1, ring_calls=2 * n, ring_q_block=local // 2,
        allgather_pairs=total_pairs / n, allgather_calls=2, total_pairs=total_pairs,
        ulysses_degree=min(n, NODE), hybrid_pairs=total_pairs / hybrid_r, hybrid_rounds=hybrid_r - 1,
        hybrid_calls=2 * hybrid_r,
    )


def main():
    nvlink, ib = MACHINES["h200-nvlink"], MACHINES["h200-infiniband"]
    print("| GPUs | tokens | ring | allgather | ulysses | hybrid (8 x N/8) | best |")
    print("|---|---|---|---|---|---|---|")
    for n in (8, 16, 64, 256):
        for s in (131072, 524288, 1048576, 4194304):
            sh = shape(s, n)
            links = nvlink if n <= NODE else ib
            times = {"ring": predict("ring", sh, links), "allgather": predict("allgather", sh, links)}
            if HQ % n == 0:
                times["ulysses"] = predict("ulysses", sh, links if n > NODE else nvlink)
            if n > NODE:
                times["hybrid"] = predict("hybrid", sh, nvlink, outer=ib)
            best = min(times, key=lambda k: times[k].total_s)
            cell = lambda k: f"{times[k].total_s * 1e3:,.1f} ms" if k in times else "n/a"  # noqa: E731
            print(f"| {n} | {s // 1024}K | {cell('ring')} | {cell('allgather')} | {cell('ulysses')} | "
                  f"{cell('hybrid')} | **{best}** |")


if __name__ == "__main__":
    main()
