"""Every strategy on a grid, measured, beside the cost model's prediction and auto's pick.

    torchrun --nproc-per-node 2 benchmarks/bench_strategies.py [--quick] [--json out.json]
    python benchmarks/bench_strategies.py --replay out.json    # this checkout's cost model, same measurements

Per point (sequence length S, heads q/kv, mask): forward + backward time of "ring", "allgather"
(where the layout allows) and "ulysses" (where the heads allow), median of --iters after a
warm-up; the model's predicted time of each (constants from dtcp.calibrate() at the start, also
printed); auto's pick (= the model's fastest). Summary: the share of points where auto's pick is
within 5% of the best measured strategy, the worst ratio pick / best, and the prediction error
(median and worst, |predicted - measured| / measured). bf16, B=1, D=128, backend="auto".

Masks: "causal" (zigzag layout), "window" (causal window (4096, 0), contiguous layout: the ring runs
only the rounds it needs), "docs" (causal documents with long-tailed lengths, fixed seed, zigzag),
and the packed batches layout="auto" shards with `Balanced`: "docs-balanced" (the same documents),
"pareto" and "lognormal" (bench_split.py's long-tailed mixes, seed 0: Pareto lengths with a 64-token
floor, and a log-normal fitted to English Wikipedia's token lengths). `--masks`, `--lengths` and
`--heads` narrow the grid (e.g. `--masks docs-balanced pareto lognormal --lengths 32768 131072`).

`--one-gpu` also times the whole sequence on one GPU (rank 0's, the other ranks waiting) with the
best kernel there is (bench_split.py's reference: FlashAttention-4 where it is installed, one dense
call or one varlen call over the documents) and prints each strategy's split = (one GPU / N) /
its time: 1.0 = N GPUs finish the call N times faster than one, communication included.

`--host-hidden` also times each call with its host hidden: every rank queues it behind a GPU sleep
of the same length (agreed by all ranks, longer than any rank's host takes to queue the call) and
an all-reduce that lets the GPUs leave the sleep together. That is the call's device time, what it
costs in a training step whose other layers keep the GPUs busy while the host runs ahead; the
plain measurement is an isolated call's, where the host's time to queue it counts too. Both are
printed (device / host ms per strategy) and judged against auto's pick.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtcp  # noqa: E402
from dtcp.layouts.balanced import balanced_placement  # noqa: E402
from _setup import init_distributed  # noqa: E402

STRATEGIES = ("ring", "allgather", "ulysses")


def doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Long-tailed document lengths (Pareto-like, 128 tokens and up) summing to `total`."""
    rng = random.Random(seed)
    lens, left = [], total
    while left > 0:
        n = min(left, max(128, int(128 * rng.paretovariate(1.1))))
        lens.append(n)
        left -= n
    return lens


def measure(fn, iters: int) -> float:
    fn()  # warm-up (builds the route, grows buffers)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return t.item()


def _agreed(value: float, op) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def measure_hidden(fn, iters: int, wall_s: float) -> tuple[float, float]:
    """(device seconds, host seconds) of one call with its host hidden, the slowest rank's
    medians. Every rank queues the call behind a GPU sleep of the same length, then an
    all-reduce of one number (the GPUs leave the sleep together), so the call runs on devices
    that are already fed: what it costs inside a training step whose other layers keep the GPUs
    busy while the host runs ahead. The sleep is agreed by all ranks and grown (2x the slowest
    host + 2 ms) until every rank's host finishes queuing before it ends."""
    from bench_split import sleep_cycles_per_ms

    sleep_ms = 2 * wall_s * 1e3 + 2.0
    one = torch.zeros(1, device="cuda")
    rows = []
    for _ in range(iters * 4):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms()))
        dist.all_reduce(one)  # a device-side barrier at the sleep's end
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        b.record()
        b.synchronize()
        slowest_host = _agreed(host_ms, dist.ReduceOp.MAX)
        if slowest_host > 0.8 * sleep_ms:  # some rank's host was not ahead: a longer sleep
            sleep_ms = 2 * slowest_host + 2.0
            continue
        rows.append((a.elapsed_time(b) / 1e3, host_ms / 1e3))
        if len(rows) == iters:
            break
    if len(rows) < iters:  # (the same on every rank: the decisions are agreed)
        raise RuntimeError(f"the host never got ahead of a {sleep_ms:.1f} ms sleep: the call waits for the device")
    device, host = (statistics.median(col) for col in zip(*rows))
    return _agreed(device, dist.ReduceOp.MAX), _agreed(host, dist.ReduceOp.MAX)


MASKS = ("causal", "window", "docs", "docs-balanced", "pareto", "lognormal")
BALANCED = ("docs-balanced", "pareto", "lognormal")  # packed documents on the Balanced layout


def documents_of(mask: str, s: int) -> tuple[int, ...]:
    if mask in ("docs", "docs-balanced"):
        return tuple(doc_lengths(s))
    import bench_split  # its long-tailed mixes, at this sequence length

    draw = bench_split.pareto_docs if mask == "pareto" else bench_split.lognormal_docs
    return draw(s, 0, 1.0)


#: The Balanced placement of each (mask, S, N) that the runs in results/ measured where their JSON
#: does not record it (runs before the twenty-third session): fingerprints (`placement_id`) of the
#: placement the code of 4512739 makes, which every earlier run still replayed had measured.
MEASURED_PLACEMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "balanced_placements_4512739.json")


def placement_id(mask: str, s: int, n: int) -> Optional[str]:
    """A fingerprint of the Balanced placement of `mask`'s documents at S = `s` over `n` ranks
    (None for the masks that do not shard with Balanced): runs record it, so that a replay judges
    a row only where this checkout places its documents as the run did."""
    if mask not in BALANCED:
        return None
    runs = balanced_placement(documents_of(mask, s), n)
    return hashlib.sha1(repr(runs).encode()).hexdigest()[:16]


def placed_as_measured(row: dict, mask: str, s: int, n: int) -> bool:
    """Whether this checkout places the row's documents as its run did (always, for masks that do
    not shard with Balanced). A run that recorded no placement measured the one in
    MEASURED_PLACEMENTS."""
    now = placement_id(mask, s, n)
    if now is None:
        return True
    recorded = row.get("placement")
    if recorded is None:
        recorded = _measured_placements().get(f"{mask}:{s}:{n}")
    return recorded == now


@functools.lru_cache(maxsize=1)
def _measured_placements() -> dict:
    """MEASURED_PLACEMENTS, read once (a replay asks for every row)."""
    with open(MEASURED_PLACEMENTS) as f:
        return json.load(f)


def mask_call(mask: str, s: int):
    """(layout, window, document boundaries or None) of a point's call. Balanced (what
    layout="auto" gives a packed row) carries its documents; zigzag takes them as cu_seqlens."""
    if mask == "window":
        return dtcp.Contiguous(), (4096, 0), None
    if mask == "causal":
        return dtcp.Zigzag(), (-1, 0), None
    lens = documents_of(mask, s)
    cu = (0, *itertools.accumulate(lens))
    return (dtcp.Balanced(lens) if mask in BALANCED else dtcp.Zigzag()), (-1, 0), cu


def one_gpu(s, hq, hkv, mask, device, iters, rank) -> float:
    """Seconds of one forward + backward of the whole sequence on rank 0's GPU with the best kernel
    (bench_split.reference), the same on every rank (broadcast); the other ranks wait meanwhile.
    NaN where it fails on rank 0 (printed; out of memory at the longest lengths): every rank goes on."""
    import bench_split

    t = torch.zeros(1, device=device, dtype=torch.float64)
    if rank == 0:
        _, window, cu = mask_call(mask, s)
        docs = None if cu is None else tuple(b - a for a, b in zip(cu, cu[1:]))
        case = bench_split.Case(mask, mask, s, (), docs=docs, window=window[0] if mask == "window" else -1)
        timer = bench_split.Timer(device, warmup=2, iters=iters, point_seconds=0.3)
        try:
            t.fill_(bench_split.reference(case, hq, hkv, 128, device, torch.bfloat16, timer, "auto")["ms"] / 1e3)
        except Exception as e:  # noqa: BLE001 - reported, and the other ranks must not wait for it
            print(f"  one GPU failed at S={s} {mask}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            t.fill_(math.nan)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.broadcast(t, 0)
    return t.item()


def splits(row: dict, n: int) -> dict:
    """Each measured strategy's split, (one GPU / N) / its time, and auto's pick's (row["one_gpu"])."""
    ideal = row["one_gpu"] / n
    out = {k: ideal / t for k, t in row["measured"].items()}
    if row["pick"] in row["measured"]:
        out["auto"] = out[row["pick"]]
    return out


def point(s, hq, hkv, mask, device, iters, n, rank, host_hidden=False, strategies=STRATEGIES):
    layout, window, cu = mask_call(mask, s)
    kwargs = dict(layout=layout, is_causal=True, enable_gqa=hq != hkv)
    if mask == "window":
        kwargs.update(window_size=window)
    if cu is not None and not isinstance(layout, dtcp.Balanced):
        kwargs.update(cu_seqlens=torch.tensor(cu, dtype=torch.int32))  # CPU boundaries: no device sync
    local = s // n
    g = torch.Generator(device=device).manual_seed(s + hq)
    q = torch.randn(1, hq, local, 128, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, hkv, local, 128, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, hkv, local, 128, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(1, hq, local, 128, device=device, dtype=torch.bfloat16, generator=g)
    explained = dtcp.explain(q, k, v, layout=layout, is_causal=True, window_size=kwargs.get("window_size"),
                             cu_seqlens=kwargs.get("cu_seqlens"))
    lines = explained.splitlines()
    pick = lines[0].split()[2]
    predicted = {ln.split()[0]: float(ln.split()[2]) / 1e3 for ln in lines[1:]}
    measured, hidden = {}, {}
    for strategy in strategies:
        if strategy not in predicted:
            continue

        def step():
            q.grad = k.grad = v.grad = None
            out = dtcp.ring_attention(q, k, v, strategy=strategy, **kwargs)
            out.backward(dout)

        try:
            measured[strategy] = measure(step, iters)
            if host_hidden:
                hidden[strategy] = measure_hidden(step, iters, measured[strategy])
        except Exception as e:  # noqa: BLE001 - a strategy the kernels cannot serve: say so, go on
            if rank == 0:
                print(f"  {strategy} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    del q, k, v, dout
    torch.cuda.empty_cache()
    row = {"S": s, "heads": f"{hq}/{hkv}", "mask": mask, "measured": measured, "predicted": predicted, "pick": pick,
           "placement": placement_id(mask, s, n)}
    if host_hidden:
        row.update(device={k: d for k, (d, _) in hidden.items()}, host={k: h for k, (_, h) in hidden.items()})
    return row


def machine_of(run: dict):
    """The calibrated constants a --json run recorded (a Machine's repr), or None (the shipped ones)."""
    from dtcp.plan.cost import Machine

    machine = run.get("machine", "None")
    return eval(machine, {"Machine": Machine}) if machine.startswith("Machine(") else None  # noqa: S307 - our own repr


def replay(path: str) -> list[dict]:
    """Re-judge a measured run (--json) with this checkout's cost model, no GPU: each point's
    call rebuilt on meta tensors (the run's world size, rank 0), predicted with the run's
    calibrated constants where its JSON holds them (else the shipped ones), auto's new pick
    against the same measured times. `placed_as_measured` is False on the rows whose documents
    this checkout places otherwise than the run did: their times belong to another placement. The
    all-gather is modelled as the run measured it: runs that do not record
    `allgather_exchange` (before the twenty-ninth session) gathered every rank's whole shard."""
    from dtcp.api import op_layout
    from dtcp.exec import route
    from dtcp.kernels import default_scale

    with open(path) as f:
        run = json.load(f)
    n = run["world_size"]
    rows = []
    with dtcp.config.override(cost_machine=machine_of(run), allgather_exchange=run.get("allgather_exchange", False)):
        for row in run["rows"]:
            s, (hq, hkv), mask = row["S"], (int(x) for x in row["heads"].split("/")), row["mask"]
            q = torch.empty(1, hq, s // n, 128, dtype=torch.bfloat16, device="meta")
            k = torch.empty(1, hkv, s // n, 128, dtype=torch.bfloat16, device="meta")
            layout, window, cu = mask_call(mask, s)
            spec, cu = op_layout(layout, cu)  # (as dtcp.explain derives the op's arguments)
            args = route.CallArgs("", spec, True, default_scale(128), "auto", window[0], window[1], "auto")
            pick, preds = route.explain(q, k, k, args, cu, n, 0)
            rows.append(dict(row, pick=pick, predicted={p.strategy: p.total_s for p in preds},
                             placed_as_measured=placed_as_measured(row, mask, s, n)))
    return rows


def summary(rows: list[dict], times: str = "measured") -> str:
    """auto's picks against `times`: "measured" (each call alone, from a barrier: its wall time)
    or "device" (--host-hidden: each call behind a sleep, its host hidden)."""
    rows = [row for row in rows if row.get(times)]
    ratios, errors = [], []
    for row in rows:
        best = min(row[times].values())
        ratios.append(row[times].get(row["pick"], float("inf")) / best)
        errors += [abs(row["predicted"][k] - t) / t for k, t in row[times].items() if k in row["predicted"]]
    within = sum(r <= 1.05 for r in ratios)
    return (f"auto within 5% of the best {times} time at {within} of {len(ratios)} points "
            f"({within / len(ratios):.0%}); worst pick/best {max(ratios):.3f}; prediction error median "
            f"{statistics.median(errors):.0%}, worst {max(errors):.0%}")


def split_summary(rows: list[dict], n: int) -> str:
    """auto's split per point, (one GPU / N) / the time of its pick, with the best strategy's."""
    lines = [f"split = (one GPU / {n}) / time, communication included (1.0: nothing lost to the split):"]
    for row in rows:
        if not math.isfinite(row.get("one_gpu") or math.nan):
            continue
        sp = splits(row, n)
        best = max((k for k in sp if k != "auto"), key=sp.get)
        lines.append(f"  S={row['S']:>6} heads {row['heads']:<5} {row['mask']:<13} one GPU {row['one_gpu'] * 1e3:8.2f} ms"
                     f" | auto ({row['pick']}) {sp.get('auto', float('nan')):.3f}, best ({best}) {sp[best]:.3f}")
    return "\n".join(lines)


def print_row(row: dict) -> None:
    best = min(row["measured"], key=row["measured"].get)
    cells = "  ".join(f"{k} {row['measured'][k] * 1e3:8.2f} ms (model {row['predicted'][k] * 1e3:8.2f})"
                      for k in STRATEGIES if k in row["measured"])
    ratio = row["measured"].get(row["pick"], float("inf")) / row["measured"][best]
    hq, hkv = row["heads"].split("/")
    print(f"S={row['S']:>6} heads {hq:>2}/{hkv:<2} {row['mask']:<13} | {cells} | best {best:<9} auto {row['pick']:<9} "
          f"x{ratio:.3f}", flush=True)
    if row.get("device"):  # --host-hidden: device / host time of each
        best = min(row["device"], key=row["device"].get)
        cells = "  ".join(f"{k} {row['device'][k] * 1e3:8.2f} / {row['host'][k] * 1e3:6.2f}"
                          for k in STRATEGIES if k in row["device"])
        ratio = row["device"].get(row["pick"], float("inf")) / row["device"][best]
        print(f"{'  host hidden: device / host ms':<43}| {cells} | best {best:<9} auto {row['pick']:<9} x{ratio:.3f}",
              flush=True)


def main():
    if "--replay" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--replay", required=True, help="a --json file of a measured run")
        rows = replay(p.parse_args().replay)
        for row in rows:
            print_row(row)
        print("\n(replayed with this checkout's cost model) " + summary(rows))
        if any(row.get("device") for row in rows):
            print("(replayed with this checkout's cost model) " + summary(rows, "device"))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--no-calibrate", action="store_true", help="use the shipped constants")
    p.add_argument("--masks", nargs="+", choices=MASKS, default=None, help="default: causal window docs")
    p.add_argument("--lengths", nargs="+", type=int, default=None)
    p.add_argument("--heads", nargs="+", default=None, help="q/kv pairs, e.g. 32/8 32/32")
    p.add_argument("--host-hidden", action="store_true",
                   help="also time each call with its host hidden (behind a GPU sleep on every rank): its device time")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                   help="time only these (an A/B of one strategy); auto's pick is then not judged")
    p.add_argument("--one-gpu", action="store_true",
                   help="also time the whole sequence on one GPU (FA4 where installed) and print each strategy's split")
    args = p.parse_args()
    device = init_distributed("cuda")
    n, rank = dist.get_world_size(), dist.get_rank()
    if not args.no_calibrate:
        machine = dtcp.calibrate()
        if rank == 0:
            print(f"calibrated: {machine}", flush=True)
    lengths = args.lengths or ([8192, 32768] if args.quick else [8192, 32768, 131072])
    heads = [(32, 8)] if args.quick else [(32, 32), (32, 8), (8, 8), (64, 8)]
    if args.heads:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    masks = args.masks or ["causal", "window", "docs"]
    grid = [(s, h, m) for s in lengths for h in heads for m in masks]
    if not args.quick and args.lengths is None and "window" in masks:
        grid += [(524288, h, "window") for h in heads]
    rows = []
    for s, (hq, hkv), mask in grid:
        row = point(s, hq, hkv, mask, device, args.iters, n, rank, args.host_hidden, tuple(args.strategies))
        if args.one_gpu:
            row["one_gpu"] = one_gpu(s, hq, hkv, mask, device, args.iters, rank)
        rows.append(row)
        if rank == 0:
            print_row(row)
    if rank == 0:
        if set(args.strategies) != set(STRATEGIES):
            print("\n(--strategies narrows each point: auto's pick is not judged)")
        else:
            print("\n" + summary(rows))
            if args.host_hidden:
                print(summary(rows, "device"))
            if args.one_gpu:
                print(split_summary(rows, n))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "machine": str(dtcp.config.cost_machine), "rows": rows,
                           "allgather_exchange": dtcp.config.allgather_exchange}, f, indent=1)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it (a CPU run aborted at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
