"""A training step's time per strategy: what `dtcp.config.cost_objective` is for.

    torchrun --nproc-per-node 4 benchmarks/bench_train_step.py --dim 4096 --ffn 14336 --heads 32/8 --json out.json
    python benchmarks/bench_train_step.py --replay out.json    # this checkout's picks, same measurements
    torchrun --nproc-per-node 2 benchmarks/bench_train_step.py --device cpu --dim 64 --ffn 128 --heads 4/2 \
        --head-dim 16 --seq 2048 --layers 1 --iters 1       # CPU smoke run (gloo, float32; no calibration)

`bench_strategies.py` times each attention call alone. Inside a training step the other layers'
matmuls keep the GPUs busy while the host queues work ahead, so a call's host time (the ring's
launches, FA4's Python) can hide behind them, or not: that depends on the model. This benchmark
runs `--layers` decoder layers, eager, bf16, forward + backward of each packed batch on every
rank: a linear QKV projection, `dtcp.ring_attention` (causal documents on `Balanced`, the layout
`layout="auto"` gives packed rows, with each strategy forced in turn), a linear output projection
and a gated MLP (`--ffn`), with residuals. The step's time, the slowest rank's median of `--iters`
after two warm-ups, per strategy; then what `strategy="auto"` picks under each cost objective
(`dtcp.explain` with the constants `dtcp.calibrate()` measured at the start): "call" (an isolated
call's time, host included) and "device" (the device's alone), and the step with
`strategy="auto"` itself under each (its live route: the pick the ranks agree on). The batches are bench_split.py's
long-tailed mixes (Pareto and log-normal, seed 0) and bench_strategies.py's documents, `--seq`
tokens over all ranks. No optimizer step and no gradient all-reduce: they cost every strategy the
same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtcp  # noqa: E402
from bench_strategies import STRATEGIES, documents_of, machine_of, placed_as_measured, placement_id  # noqa: E402
from dtcp.plan import decoder_layer_flops_per_token  # noqa: E402

OBJECTIVES = ("call", "device", "step")


def objective_settings(objective: str, flops: float) -> dict:
    """dtcp.config settings of one objective ("step": with the layer's FLOPs per token)."""
    return dict(cost_objective=objective, layer_flops_per_token=flops if objective == "step" else None)


class Layer(nn.Module):
    """One decoder layer: QKV projection, attention (a callable on (B, H, L, D) tensors), output
    projection and a gated MLP, with residuals (no norms: they cost every strategy the same)."""

    def __init__(self, dim: int, ffn: int, q_heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.qkv = nn.Linear(dim, (q_heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(q_heads * head_dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, attention):  # x: (B, L, dim)
        b, l, _ = x.shape
        heads = self.qkv(x).view(b, l, self.q_heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = heads.split([self.q_heads, self.kv_heads, self.kv_heads], dim=1)
        x = x + self.o(attention(q, k, v).transpose(1, 2).reshape(b, l, -1))
        gate, up = self.up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def picks(layout, q_heads: int, kv_heads: int, head_dim: int, n: int, seq: int, flops: float) -> dict:
    """What strategy="auto" takes for this call under each objective (the cost model's ranking,
    dtcp.exec.route.explain, as dtcp.explain gives it, on meta tensors of rank 0's shapes, with
    dtcp.config.cost_machine: calibrated at the start, or the replayed run's). `flops`: the
    layer's FLOPs per token (the "step" objective's)."""
    from dtcp.api import op_layout
    from dtcp.exec import route
    from dtcp.kernels import default_scale

    q = torch.empty(1, q_heads, seq // n, head_dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, kv_heads, seq // n, head_dim, dtype=torch.bfloat16, device="meta")
    spec, cu = op_layout(layout)  # (its documents: the spec and boundaries the op receives)
    args = route.CallArgs("", spec, True, default_scale(head_dim), "auto", -1, 0, "auto")
    out = {}
    for objective in OBJECTIVES:
        with dtcp.config.override(**objective_settings(objective, flops)):
            out[objective] = route.explain(q, k, k, args, cu, n, 0)[0]
    return out


def step_times(layers, x0, layout, enable_gqa: bool, iters: int, strategies=STRATEGIES) -> dict:
    """The step's time per strategy (the slowest rank's median), seconds."""
    times = {}
    for strategy in strategies:
        def attention(q, k, v, strategy=strategy):
            return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=enable_gqa, strategy=strategy)

        def step():
            h = x0.clone().requires_grad_()
            for layer in layers:
                h = layer(h, attention)
            h.float().square().mean().backward()

        try:
            for _ in range(2):  # warm-up: builds the routes, FA4's kernels
                step()
            runs = []
            for _ in range(iters):
                dist.barrier()
                _sync(x0.device)
                t0 = time.perf_counter()
                step()
                _sync(x0.device)
                runs.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a strategy the kernels or heads cannot serve: say so, go on
            if dist.get_rank() == 0:
                print(f"  {strategy} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        t = torch.tensor([statistics.median(runs)], device=x0.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[strategy] = t.item()
    return times


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_row(row: dict) -> None:
    times = row["step_s"]
    best = min(times, key=times.get)
    cells = "  ".join(f"{s} {t * 1e3:8.2f} ms" for s, t in times.items())
    chosen = "  ".join(f"auto ({o}) -> {row['picks'][o]} x{times.get(row['picks'][o], float('inf')) / times[best]:.3f}"
                       + (f" (run: {row['auto_step_s'][o] * 1e3:.2f} ms)" if o in row.get("auto_step_s", {}) else "")
                       for o in OBJECTIVES)
    print(f"{row['mask']:<14} dim {row['dim']} ffn {row['ffn']} x{row['layers']} heads {row['heads']}: {cells} | "
          f"best {best} | {chosen}", flush=True)


def summary(rows: list[dict]) -> str:
    parts = []
    for objective in OBJECTIVES:
        ratios = [r["step_s"].get(r["picks"][objective], float("inf")) / min(r["step_s"].values()) for r in rows]
        parts.append(f"auto ({objective}) within 5% of the fastest step at {sum(x <= 1.05 for x in ratios)} of "
                     f"{len(ratios)}, worst x{max(ratios):.3f}")
    return "; ".join(parts)


def replay(path: str, machine=None) -> list[dict]:
    """Each row's picks again with this checkout's cost model and the run's calibrated constants
    (or `machine`, a dtcp.plan.Machine); `placed_as_measured` False where this checkout places the
    row's documents otherwise than the run did (bench_strategies.placed_as_measured)."""
    with open(path) as f:
        run = json.load(f)
    rows = []
    # (the all-gather as the run had it: runs before the twenty-ninth session gathered whole shards)
    with dtcp.config.override(cost_machine=machine_of(run) if machine is None else machine,
                              allgather_exchange=run.get("allgather_exchange", False)):
        for row in run["rows"]:
            q_heads, kv_heads = (int(x) for x in row["heads"].split("/"))
            layout = dtcp.Balanced(documents_of(row["mask"], row["seq"]))
            head_dim = row.get("head_dim", 128)
            flops = decoder_layer_flops_per_token(row["dim"], row["ffn"], q_heads, kv_heads, head_dim)
            rows.append(dict(row, picks=picks(layout, q_heads, kv_heads, head_dim, run["world_size"], row["seq"],
                                              flops),
                             placed_as_measured=placed_as_measured(row, row["mask"], row["seq"], run["world_size"])))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replay", default=None, help="no runs: this checkout's picks on a --json run's measurements")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", default="32/8", help="query/key-value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, float32 (a smoke run)")
    p.add_argument("--seq", type=int, default=32768, help="tokens of the packed batch, over all ranks")
    p.add_argument("--masks", nargs="+", default=["pareto", "lognormal", "docs-balanced"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.replay:
        rows = replay(args.replay)
        for row in rows:
            print_row(row)
        print("\n(replayed with this checkout's cost model) " + summary(rows))
        return
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n, rank = dist.get_world_size(), dist.get_rank()
    machine = dtcp.calibrate() if cuda else dtcp.config.cost_machine  # (CPU: the shipped constants)
    if rank == 0:
        print(f"calibrated: {machine}" if cuda else "(cpu: the shipped cost constants)", flush=True)
    q_heads, kv_heads = (int(x) for x in args.heads.split("/"))
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(args.dim, args.ffn, q_heads, kv_heads, args.head_dim) for _ in range(args.layers))
    layers = layers.to(device, dtype)
    x0 = torch.randn(1, args.seq // n, args.dim, device=device, dtype=dtype)
    flops = decoder_layer_flops_per_token(args.dim, args.ffn, q_heads, kv_heads, args.head_dim)
    rows = []
    for mask in args.masks:
        layout = dtcp.Balanced(documents_of(mask, args.seq))
        row = dict(mask=mask, dim=args.dim, ffn=args.ffn, layers=args.layers, heads=args.heads,
                   head_dim=args.head_dim, seq=args.seq, placement=placement_id(mask, args.seq, n),
                   step_s=step_times(layers, x0, layout, q_heads != kv_heads, args.iters),
                   picks=picks(layout, q_heads, kv_heads, args.head_dim, n, args.seq, flops))
        # strategy="auto" itself, under each objective: its live route (the pick, agreed by the ranks)
        row["auto_step_s"] = {}
        for objective in OBJECTIVES:
            with dtcp.config.override(**objective_settings(objective, flops)):
                got = step_times(layers, x0, layout, q_heads != kv_heads, args.iters, strategies=("auto",))
            if "auto" in got:
                row["auto_step_s"][objective] = got["auto"]
        rows.append(row)
        if rank == 0:
            print_row(row)
    if rank == 0:
        print("\n" + summary(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "device": args.device, "machine": str(machine), "rows": rows,
                           "allgather_exchange": dtcp.config.allgather_exchange}, f, indent=1)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it (a CPU run aborted at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
