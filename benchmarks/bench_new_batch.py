"""The host time a new batch costs before its first attention launch (CPU; no GPU needed).

Training loops bring a new document structure every step. bench_split.py, bench_strategies.py and
bench_train_step.py time passes whose route is already built (the same batch every step), so they
leave out what each new batch costs the host first, while the device waits for it: the Hugging
Face block's reads of the batch (it must read the document boundaries on the host, a device
synchronisation, and it agrees with the other ranks on a digest of the token ids), the `Balanced`
placement that `layout="auto"` takes, and the route the first `dtcp.ring_attention` call builds
(every rank's plans for every strategy, the fused launches and the cost model: what
`strategy="auto"` does on CUDA, here on meta tensors as `dtcp.explain` does). All of it is
host-side Python, so this CPU's timing is the real thing (a GPU machine's host may be faster).

For each of bench_split.py's long-tailed mixes (128K tokens) and N, `--batches` new structures
(the mix's documents rotated: a new `cu_seqlens` each time, so no cache is hit), the median ms of:

    ids digest      the block's agreement digest of the batch's token ids (`tensor_digest`), and,
                    for reference, the text digest it used before (`digest` of a list of ints)
    boundaries      documents from position_ids (HF's packing rule) and the global cu_seqlens
    placement       `Auto().resolve(...)` and the rank's positions (`Balanced` placement)
    route           the first call's route build for 32/8 heads of 128 dims, bf16, causal

    python benchmarks/bench_new_batch.py --world-sizes 4 8 16 --batches 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_split as B  # noqa: E402
from dtcp.comm.guard import digest, tensor_digest  # noqa: E402
from dtcp.exec.route import CallArgs, explain  # noqa: E402
from dtcp.integrations.transformers.batch import _boundaries_from_positions, _cu_seqlens  # noqa: E402
from dtcp.kernels import default_scale  # noqa: E402
from dtcp.layouts import Auto  # noqa: E402

CASES = ("pareto-s0", "lognormal-s0", "pareto-s1", "lognormal-s1")


def packed_batch(docs: list[int], vocab: int = 150_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids), (1, S) each, for one packed row of `docs` (positions restart at
    every document, as DataCollatorWithFlattening gives them)."""
    ids = torch.randint(0, vocab, (1, sum(docs)), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return ids, pos


def timed_ms(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def one_batch(docs: list[int], n: int, hq: int, hkv: int, head_dim: int, old_digest: bool) -> dict:
    """Each stage's host ms for one new batch of `docs` on rank 0 of `n`."""
    seq = sum(docs)
    ids, pos = packed_batch(docs)
    row = {}
    row["ids_digest_ms"], _ = timed_ms(lambda: tensor_digest(ids))
    if old_digest:
        row["ids_text_digest_ms"], _ = timed_ms(lambda: digest(ids.detach().to("cpu").flatten().tolist()))

    def boundaries():
        starts = _boundaries_from_positions(pos)
        return _cu_seqlens(starts, seq)
    row["boundaries_ms"], cu = timed_ms(boundaries)

    def placement():
        layout = Auto().resolve(cu, seq)
        layout.global_positions(seq, n, 0)
        return layout
    row["placement_ms"], layout = timed_ms(placement)

    local = seq // n
    q = torch.empty(1, hq, local, head_dim, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, hkv, local, head_dim, device="meta", dtype=torch.bfloat16)
    args = CallArgs("", layout.op_spec(), True, default_scale(head_dim), "auto", -1, 0, "auto")
    cu_values = tuple(layout.cu_seqlens.tolist())
    row["route_ms"], (pick, _) = timed_ms(lambda: explain(q, k, k, args, cu_values, n, 0, 0, 0, backward=True))
    row["pick"] = pick
    return row


def run(cases: list[str], world_sizes: list[int], batches: int, hq: int, hkv: int, head_dim: int,
        scale: float = 1.0, old_digest: bool = True) -> list[dict]:
    by_name = {c.name: c for c in B.build_cases(scale)}
    records = []
    for name in cases:
        docs = list(by_name[name].docs)
        for n in world_sizes:
            rows = []
            # batch 0 warms imports and first-use code paths; then a new structure per batch
            for i in range(batches + 1):
                shift = (7 * i + 1) % len(docs)
                rotated = docs[shift:] + docs[:shift]
                row = one_batch(rotated, n, hq, hkv, head_dim, old_digest)
                if i:
                    rows.append(row)
            keys = [k for k in rows[0] if k.endswith("_ms")]
            rec = dict(case=name, world_size=n, seq_len=sum(docs), num_docs=len(docs), batches=len(rows),
                       picks=sorted({r["pick"] for r in rows}),
                       **{k: statistics.median(r[k] for r in rows) for k in keys})
            rec["total_ms"] = sum(rec[k] for k in ("ids_digest_ms", "boundaries_ms", "placement_ms", "route_ms"))
            records.append(rec)
            print(f"{name:13s} N={n:2d} docs={len(docs):3d}  digest {rec['ids_digest_ms']:6.2f}"
                  + (f" (text {rec['ids_text_digest_ms']:6.1f})" if old_digest else "")
                  + f"  boundaries {rec['boundaries_ms']:5.2f}  placement {rec['placement_ms']:6.1f}"
                  f"  route {rec['route_ms']:6.1f}  total {rec['total_ms']:6.1f} ms  auto -> {'/'.join(rec['picks'])}",
                  flush=True)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--world-sizes", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--batches", type=int, default=5, help="new document structures per point (median)")
    p.add_argument("--heads", default="32/8", help="query/key-value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-scale", type=float, default=1.0, help="bench_split's case scale (smoke runs: small)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, host ms per new batch (median of {args.batches})")
    records = run(args.cases, args.world_sizes, args.batches, hq, hkv, args.head_dim, args.seq_scale)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=dict(torch=torch.__version__, cpus=os.cpu_count(), heads=args.heads,
                                     head_dim=args.head_dim, batches=args.batches), points=records), f, indent=1)


if __name__ == "__main__":
    main()
