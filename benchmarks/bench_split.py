"""What splitting the work over N ranks costs in compute: every strategy's real per-rank schedule on one device.

One process, one device (cuda or cpu), no communication. For each case, heads configuration, N
simulated ranks and layout, each strategy's per-rank plan is built as a real call builds it
(dtcp/exec/route.py: `_problem`, `_plan_and_kernel`, `_heads_route`, from plain numbers as
`dtcp.explain` does) and run through dtcp's own executors (route `_forward`/`_backward`, which
dispatch to exec.ring / exec.allgather), timed rank by rank:

  ring       the rank's RingPlan through ring_forward/ring_backward with `NoComm`: the rank's own
             K/V stand in for the received blocks (whatever launches the ring makes per step:
             this benchmark picks up fused launches by itself);
  allgather  the rank's queries against the whole sequence's keys (its AllGatherPlan, or the
             VarlenPlan for documents), through allgather_forward/backward with the all-gather
             and reduce-scatter replaced by local stand-ins (a gathered buffer of full length,
             built once during warmup: the rank's K/V repeated N times): no collective;
  ulysses    the whole sequence with Hq/N heads (local attention; documents as one varlen call
             where the kernel takes it). Every rank runs the same shapes: one rank is timed;
  hybrid     each U x R factorization of N: Ulysses over U (Hq/U heads), then the inner ring (or
             all-gather, as the real route picks) over R ranks on Grouped(layout, U): each ring
             rank is timed (the U ranks of a head group run the same shapes).

Timings: CUDA events around forward and backward (or perf_counter on CPU), warmup first (the
first run also counts kernel calls and compiles FA4's kernels), then the median of `--iters`
iterations (fewer when they add up to `--point-seconds`; short ones go on, up to 8x `--iters`,
until they do). The forward time is the forward part of the same runs. Against the whole sequence on one device with the best kernel (on
CUDA: FlashAttention-4, `dtcp.kernels.KERNELS["fa4"]`, its dense call for causal and windows and
its varlen call for documents, when importable; else dtcp's "auto" kernel):

  split       = (one device / N) / slowest rank        1.0 = nothing lost to the split
  total work  = sum over ranks / one device            1.0 = no extra work in all
  launches    = attention kernel calls per rank, forward and backward (a varlen call counts one
                where the kernel makes it one launch: FA4, flash; a loop of calls otherwise)
  work        = visible (query, key) pairs x query heads per rank, from the plans (exact, no timing)
  peak MiB    = torch.cuda.max_memory_allocated during one rank's runs (its inputs included)

Where the time goes, in the GPU's loaded state (`Timer.steady_pass`: each pass queued right behind
another and timed from that one's end, as inside a training loop; the one device's pass alike),
for the rank slowest there:
  steady      = (one device's steady time / N) / that rank's (split_steady: like for like, the
                first launch's host latency hidden behind the pass before)
  attn eff    = its attention calls against the one-device pass's on its share of the work
  other ms    = its steady time outside the attention calls (dtcp's merges, adds, copies, fills,
                and the host's gaps where it queues slower than the device runs)
  host ms     = its host time to queue the pass (`Timer.device_pass`, behind a GPU sleep); bound
                "host" where that exceeds its device time there, "sync" where the pass waits for
                the device (a synchronizing call inside it), else "device"
  w/o kern    = the same pass's host time with the kernel's calls replayed from a recorded pass
                (`Timer.host_split`): dtcp's part; host ms minus this is the kernel's own (FA4's
                Python, allocations and launches)
  (JSON only: launch_efficiency, each of that rank's ring launches against the one device's rate,
  forward and backward, with its share of the work: which launches lose the kernel's rate)
`Timer.device_pass`'s figures (device_ms behind a sleep: split_device, kernel_efficiency,
other_ms) stay in the JSON. They are a rested GPU's: at its power cap an H200 runs the 10-60 ms
after a sleep at a higher clock (the one-GPU causal 32K pass 44.2 ms after a 30 ms sleep, 49.1
back to back), which favours a rank's short pass over the one device's long one.

Auto check: for every (case, heads, N, layout), the strategy `strategy="auto"` would pick (the
cost model's ranking, `dtcp.exec.route.explain`, which `dtcp.explain` calls; on CUDA with CUDA
tensors of the call's shapes, on CPU with meta tensors) is compared with the measured slowest-rank
forward+backward times of the 1-D strategies (ring, allgather, ulysses): the benchmark prints the
fraction of points where auto's pick is within 5% of the best (the issue's target: >= 90%).

Cases (lengths times `--seq-scale`):
  causal-32k, causal-128k, causal-512k   causal, zigzag (512K: GQA only, N >= 8, 4 ranks timed,
                                         ring and Ulysses, to fit the time budget)
  window-128k                            causal window (4096, 0), contiguous
  docs-16x8k                             16 causal documents of 8K, zigzag / DocZigzag / Balanced
  pareto-s0, pareto-s1                   long-tailed: Pareto lengths, shape alpha 0.8, 64-token
                                         floor, seeds 0 and 1 (S = 128K, the last document cut to fill:
                                         102 documents, the longest 69K; 207, the longest 29K)
  lognormal-s0, lognormal-s1             log-normal lengths fitted to a public corpus (below; 172
                                         documents, the longest 7K; 156, the longest 16K)
They run in this order with causal-512k last (a run cut short by --max-seconds loses the last).
Heads: GQA 32/8 and MHA 32/32 (documents and 512K: GQA only; `--heads gqa mha` for both), D=128, bf16. Hybrid runs on
one layout per case (Balanced for documents). Ulysses and all-gather run where the heads and the
layout allow them (the all-gather takes contiguous and zigzag only).

The log-normal: English Wikipedia (a component of The Pile, RedPajama and SlimPajama) has a
published histogram of document lengths in tokens, 6,458,670 documents, in the dataset card of
huggingface.co/datasets/seonglae/wikipedia_token (commit b7a46d0): <= 1024 tokens 5,320,881;
1024-2048 693,911; 2048-4096 300,935; 4096-8192 106,221; 8192-16384 30,611; 16384-32768 4,812;
32768-65536 1,253; 65536-128000 46. A least-squares fit of ln(edge) = mu + sigma * probit(CDF)
at the seven inner edges (done below, `lognormal_fit`) gives mu = 5.80, sigma = 1.25: median 330
tokens, mean 724. (For scale: C4's English split holds 364,868,892 documents (its dataset card,
allenai/c4) and about 156B tokens (Dodge et al. 2021), a mean of about 430 T5 tokens.)

Runs:
    python benchmarks/bench_split.py --out split.json --plot split.png        # whole grid, < 8 min on an H100
    python benchmarks/bench_split.py --quick --out split_quick.json           # the issue's table rows, < 4 min
    python benchmarks/bench_split.py --plot-from split.json --plot split.png  # the plot from a JSON (no GPU)
    python benchmarks/bench_split.py --device cpu --seq-scale 1/128 --heads 4/2 --head-dim 16 \\
        --dtype float32 --world-sizes 2 4 --cases causal-32k docs-16x8k --iters 1 --warmup 1   # CPU smoke

A point that fails (an error, out of memory) is reported (printed and in the JSON under "error")
and the run goes on with the next. `--max-seconds` stops starting new points after that long
(they are listed as skipped).
"""

from __future__ import annotations

import argparse
import gzip
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

import torch

from dtcp.comm.p2p import NoComm
from dtcp.config import config as dtcp_config
from dtcp.exec import allgather as exec_allgather
from dtcp.exec import route as R
from dtcp.exec.fused import fused_steps
from dtcp.kernels import KERNELS, VarlenSeqs, default_scale, select_kernel
from dtcp.layouts import Balanced, Contiguous, DocZigzag, Layout, Zigzag
from dtcp.layouts.balanced import MIN_CHUNK
from dtcp.plan import RingPlan, Task, allgather_reason, head_splits, plan_pairs

ONE_D_STRATEGIES = ("ring", "allgather", "ulysses")  # what `auto` chooses among on a 1-D group

# ---- document mixes ---------------------------------------------------------------------------------------

# English Wikipedia's document lengths in tokens (see the module docstring): (upper bin edge, documents)
WIKIPEDIA_TOKEN_HISTOGRAM = ((1024, 5320881), (2048, 693911), (4096, 300935), (8192, 106221), (16384, 30611),
                             (32768, 4812), (65536, 1253), (128000, 46))


def lognormal_fit(histogram=WIKIPEDIA_TOKEN_HISTOGRAM) -> tuple[float, float]:
    """(mu, sigma) of ln(length): least squares of ln(edge) = mu + sigma * probit(CDF(edge)) over
    the histogram's inner edges (the last bin's edge has CDF 1)."""
    total = sum(c for _, c in histogram)
    nd = statistics.NormalDist()
    xs, ys, cum = [], [], 0
    for edge, count in histogram[:-1]:
        cum += count
        xs.append(nd.inv_cdf(cum / total))
        ys.append(math.log(edge))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sigma = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - sigma * mx, sigma


def fill(draw: Callable[[], int], total: int) -> tuple[int, ...]:
    """Documents drawn until they hold `total` tokens, the last one cut to fill exactly."""
    docs: list[int] = []
    while sum(docs) < total:
        docs.append(max(1, min(total, draw())))
    docs[-1] -= sum(docs) - total
    return tuple(d for d in docs if d > 0)


def pareto_docs(total: int, seed: int, scale: float, alpha: float = 0.8, floor: int = 64) -> tuple[int, ...]:
    rng = random.Random(seed)
    low = max(4, round(floor * scale))
    return fill(lambda: int(low * rng.paretovariate(alpha)), total)


def lognormal_docs(total: int, seed: int, scale: float) -> tuple[int, ...]:
    rng = random.Random(1000 + seed)
    mu, sigma = lognormal_fit()
    mu += math.log(scale)
    return fill(lambda: max(4, round(rng.lognormvariate(mu, sigma))), total)


# ---- cases ------------------------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    mask: str  # "causal" | "window" | "documents" | "long-tailed"
    seq_len: int
    layouts: tuple[str, ...]
    docs: Optional[tuple[int, ...]] = None
    window: int = -1  # causal window (W, 0); -1: none
    heads: tuple[str, ...] = ("gqa", "mha")
    min_world: int = 2
    strategies: tuple[str, ...] = ("ring", "allgather", "ulysses", "hybrid")
    hybrid_layout: Optional[str] = None  # the one layout hybrid runs on (default: the first)
    rank_sample: int = 0  # time at most this many ranks of a ring / all-gather point (0: all)
    note: str = ""


HEAD_PRESETS = {"gqa": (32, 8), "mha": (32, 32)}
DOC_LAYOUTS = ("zigzag", "doczigzag", "balanced")


def scaled(n: int, scale: float, multiple: int = 32) -> int:
    """n * scale rounded up to a multiple of `multiple` (2 x the largest N: every layout's length)."""
    return max(multiple, -(-round(n * scale) // multiple) * multiple)


def build_cases(scale: float) -> list[Case]:
    k = 1024
    s128 = scaled(128 * k, scale)
    # In order of importance: a run cut short by --max-seconds loses the last ones.
    cases = [
        Case("causal-32k", "causal", scaled(32 * k, scale), ("zigzag",)),
        Case("causal-128k", "causal", s128, ("zigzag",)),
        Case("window-128k", "window", s128, ("contiguous",), window=max(1, round(4096 * scale))),
        Case("docs-16x8k", "documents", s128, DOC_LAYOUTS, docs=(s128 // 16,) * 16, heads=("gqa",),
             hybrid_layout="balanced"),
    ]
    for seed in (0, 1):
        cases.append(Case(f"pareto-s{seed}", "long-tailed", s128, DOC_LAYOUTS, docs=pareto_docs(s128, seed, scale),
                          heads=("gqa",), hybrid_layout="balanced", note="Pareto shape 0.8, floor 64"))
        cases.append(Case(f"lognormal-s{seed}", "long-tailed", s128, DOC_LAYOUTS,
                          docs=lognormal_docs(s128, seed, scale), heads=("gqa",), hybrid_layout="balanced",
                          note="log-normal fitted to Wikipedia's token lengths"))
    cases.append(Case("causal-512k", "causal", scaled(512 * k, scale), ("zigzag",), heads=("gqa",), min_world=8,
                      strategies=("ring", "ulysses"), rank_sample=4, note="GQA only, N >= 8, 4 ranks timed"))
    return cases


# The issue's table rows, in less than 4 minutes on one H100
QUICK = dict(cases=("causal-32k", "causal-128k", "window-128k", "docs-16x8k", "pareto-s0"), world_sizes=(2, 4, 8),
             strategies=("ring", "ulysses"))


# ---- simulated ranks --------------------------------------------------------------------------------------

class _Group:
    """Stands for a GroupState where the builders and executors only read size and rank; there is
    no process group (nothing is exchanged)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    @staticmethod
    def comm_group():
        return None


# every collective dtcp/exec/allgather.py calls (what it imports from dtcp.comm.collectives)
COLLECTIVES = ("all_gather_kv", "reduce_scatter_dkv", "exchange_rows")


@contextlib.contextmanager
def local_collectives():
    """The all-gather schedule's collectives as local stand-ins: the gathered K/V is a buffer of
    the whole length holding this rank's K/V N times (built on first use, in the warmup, and
    reused: no copy is timed), and the reduce-scatter keeps this rank's part. Where only the keys
    other ranks read move (`exchange_rows`, plan.KeyExchange), the rows received are this rank's
    own sent rows repeated to the received count (built once likewise); the packing's index,
    stack and cat around the exchange run as in a real call."""
    for name in COLLECTIVES:
        if not hasattr(exec_allgather, name):
            raise RuntimeError(f"dtcp.exec.allgather.{name} is gone: update bench_split.local_collectives")
    cache: dict = {}

    def gather(send, pg, world_size):
        if world_size == 1:
            return send
        key = (tuple(send.shape), send.dtype, send.device, world_size)
        if key not in cache:
            cache[key] = send.repeat((world_size,) + (1,) * (send.dim() - 1))
        return cache[key]

    def scatter(send, pg, world_size):
        return send if world_size == 1 else send[: send.shape[0] // world_size]

    def exchange(send, send_rows, recv_rows, pg, kind, out=None):
        rows = sum(recv_rows)
        key = ("exchange", kind, tuple(send.shape), send.dtype, send.device, rows)
        if key not in cache:
            if send.shape[0] == 0:  # (this rank sends nothing: stand-in values from no row of its own)
                cache[key] = send.new_zeros((rows,) + send.shape[1:])
            else:
                times = -(-rows // send.shape[0])
                cache[key] = send.repeat((times,) + (1,) * (send.dim() - 1))[:rows].contiguous()
        if out is None:
            return cache[key]
        # (received into a buffer of the caller's: the all-to-all writes it; here a copy stands in,
        # timed, where the real call's transfer is not)
        return out.copy_(cache[key])

    stand_ins = {"all_gather_kv": gather, "reduce_scatter_dkv": scatter, "exchange_rows": exchange}
    saved = {name: getattr(exec_allgather, name) for name in COLLECTIVES}
    for name in COLLECTIVES:
        setattr(exec_allgather, name, stand_ins[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(exec_allgather, name, fn)
        cache.clear()


_KERNEL_METHODS = ("forward", "backward", "forward_into", "backward_into", "varlen_forward", "varlen_backward",
                   "varlen_forward_into", "varlen_backward_into")


@contextlib.contextmanager
def shadowing(kernel, wrap: Callable):
    """While inside, each of `kernel`'s attention methods is `wrap(name, method)` on the instance
    (KERNELS holds one instance per kernel); restored after."""
    patched = []
    for name in _KERNEL_METHODS:
        method = getattr(kernel, name, None)
        if method is None:
            continue
        kernel.__dict__[name] = wrap(name, method)
        patched.append(name)
    try:
        yield
    finally:
        for name in patched:
            kernel.__dict__.pop(name, None)


def counting(kernel, counts: dict):
    """Count `kernel`'s calls into counts["fwd"] / counts["bwd"] while inside (`shadowing`). A
    varlen call counts one where the kernel makes it one launch; otherwise its loop of dense calls
    counts. A counted call made inside another counted one (FA4's varlen_forward calling its
    varlen_forward_into) counts once."""
    inside = [0]

    def wrap(name, method):
        side = "bwd" if "backward" in name else "fwd"
        one = not name.startswith("varlen") or kernel.varlen_one_launch

        def wrapper(*a, **kw):
            counted = one and not inside[0]
            if not counted:
                return method(*a, **kw)
            counts[side] += 1
            inside[0] += 1
            try:
                return method(*a, **kw)
            finally:
                inside[0] -= 1
        return wrapper
    return shadowing(kernel, wrap)


def replaying(kernel, results: list, record: bool):
    """While inside (`shadowing`): each outermost call of `kernel`'s attention methods is made and
    its result appended to `results` (record=True), or not made at all, the next recorded result
    returned in its place (record=False; in call order: the pass must make the calls it made when
    recorded; copies of them are kept, since a call given output tensors returns those and the
    pass adds into them later). A pass replayed so costs the host what is left of it without the
    kernel: dtcp's Python and tensor ops (merges, adds, views, and the copies by which a replayed
    result lands in a call's output tensors), not the kernel's own Python, allocations and
    launches (Timer.host_split)."""
    inside, at = [0], [0]

    def wrap(name, method):
        def wrapper(*a, **kw):
            if inside[0]:
                return method(*a, **kw)
            if not record:
                got = results[at[0]]
                at[0] += 1
                return got
            inside[0] += 1
            try:
                got = method(*a, **kw)
            finally:
                inside[0] -= 1
            # (a copy: a call given output tensors returns those, which the pass then adds into)
            results.append(tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in got))
            return got
        return wrapper
    return shadowing(kernel, wrap)


@dataclass
class RankJob:
    """One simulated rank of one strategy: its route, plan, kernel and input shapes."""

    route: R.Route
    plan: object
    kernel: object
    q_shape: tuple
    kv_shape: tuple
    keep: bool  # keep what the forward gathered for the backward (the eager autograd path)
    work: int  # visible (query, key) pairs x query heads
    weight: int = 1  # ranks this one stands for (identical shapes)
    rank: int = 0


def plan_work(plan) -> int:
    if isinstance(plan, tuple):
        return sum(plan_work(p) for p in plan)
    return plan_pairs(plan.tasks)


def plan_kind(plan) -> str:
    if isinstance(plan, tuple):
        return "per-row " + plan_kind(plan[0])
    return type(plan).__name__


@dataclass
class Point:
    """What one (case, heads, N, layout) is: the call's arguments as dtcp.ring_attention gives them."""

    case: Case
    hq: int
    hkv: int
    head_dim: int
    n: int
    layout_name: str
    layout: Layout
    args: R.CallArgs
    cu_values: Optional[tuple]
    local_len: int


def make_point(case: Case, layout_name: str, hq: int, hkv: int, d: int, n: int, backend: str,
               min_chunk: int = MIN_CHUNK) -> Point:
    s = case.seq_len
    window = (case.window, 0) if case.window >= 0 else (-1, -1)
    cu_values = None
    docs = case.docs
    if layout_name == "zigzag":
        layout, spec = Zigzag(), "zigzag"
    elif layout_name == "contiguous":
        layout, spec = Contiguous(), "contiguous"
    elif layout_name == "doczigzag":
        layout = DocZigzag(docs)
        spec, s = "doczigzag", layout.padded_len(n)
    elif layout_name == "balanced" or is_balanced_variant(layout_name):
        docs = pad_last(docs, n)
        options = balanced_variant(layout_name, n, min_chunk)
        layout = Balanced(docs, **options)
        spec, s = layout.op_spec(), sum(docs)
    else:
        raise ValueError(f"unknown layout {layout_name!r}")
    if docs is not None:
        cu = [0]
        for length in docs:
            cu.append(cu[-1] + length)
        cu_values = tuple(cu)
    layout.check(s, n)
    args = R.CallArgs("", spec, True, default_scale(d), backend, window[0], window[1], "auto")
    return Point(case, hq, hkv, d, n, layout_name, layout, args, cu_values, s // n)


def is_balanced_variant(name: str) -> bool:
    """`--layouts balanced@<min_chunk>+<hidden_steps>` (either part optional, "+N" = every step
    hidden): `Balanced` with those options, beside the case's own `balanced`."""
    return name.startswith(("balanced@", "balanced+"))


def balanced_variant(name: str, n: int, min_chunk: int) -> dict:
    """Balanced's keyword arguments for layout `name` ("balanced": the run's --min-chunk, no
    hidden steps; "balanced@128+N": min_chunk 128, hidden_steps N) over n ranks."""
    if name == "balanced":
        return dict(min_chunk=min_chunk)
    head, _, hidden = name.partition("+")
    _, _, chunk = head.partition("@")
    try:
        return dict(min_chunk=int(chunk) if chunk else min_chunk,
                    hidden_steps=(n if hidden == "N" else int(hidden)) if hidden else 0)
    except ValueError:
        raise ValueError(f"--layouts {name!r}: expected balanced@<min_chunk>+<hidden_steps or N>, e.g. "
                         "balanced@128+N") from None


def case_layouts(case: Case, wanted: Optional[list[str]]) -> list[str]:
    """The layouts a case runs: its own (those of `wanted` only, where given), then the Balanced
    variants of `wanted` for cases that have `balanced`."""
    own = [name for name in case.layouts if not wanted or name in wanted]
    extra = [name for name in wanted or () if is_balanced_variant(name) and "balanced" in case.layouts]
    return own + extra


def pad_last(docs: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """The last document padded so that the total is a multiple of `multiple` (Balanced takes no padding)."""
    extra = -sum(docs) % multiple
    return docs[:-1] + (docs[-1] + extra,) if extra else docs


def _empty(shape, device, dtype):
    return torch.empty(shape, device=device, dtype=dtype)


def rank_jobs(point: Point, strategy: str, device, dtype, u: int = 0) -> list[RankJob]:
    """Every simulated rank of `strategy` at `point` (hybrid: U = u), built by dtcp's own route
    builders; ranks with identical shapes are one job with a weight."""
    n, l_len, d = point.n, point.local_len, point.head_dim
    q = _empty((1, point.hq, l_len, d), device, dtype)
    k = _empty((1, point.hkv, l_len, d), device, dtype)
    jobs = []
    if strategy in ("ring", "allgather"):
        if strategy == "allgather":
            why = allgather_reason(point.layout, l_len, n, one_launch=point.cu_values is not None)
            if why is not None:
                raise NotApplicable(why)
        built = []
        for r in range(n):
            problem = R._problem(q, point.args, point.cu_values, _Group(n, r), None)
            try:
                built.append(R._plan_and_kernel(strategy, problem.layout, q, k, k, point.args, problem.row_segments,
                                                n, r, False))
            except ValueError as e:
                if strategy == "allgather":  # the route's refusal (no one-launch varlen kernel for these runs)
                    raise NotApplicable(str(e)) from None
                raise
        # the ring's steps per launch as route_for chooses them (the setting, or "auto": the cost model's)
        size = R.ring_steps([plan for plan, _ in built], built[0][1], q, k, k, n) if strategy == "ring" else 1
        for r, (plan, kernel) in enumerate(built):
            route = R.Route(_Group(n, r), None, strategy, strategy, None, plan, kernel, {}, None, size)
            jobs.append(RankJob(route, plan, kernel, tuple(q.shape), tuple(k.shape), True,
                                plan_work(plan) * point.hq, rank=r))
        return jobs
    if strategy == "ulysses":
        try:
            head_splits(point.hq, point.hkv, n, "ulysses")
        except ValueError as e:
            raise NotApplicable(str(e)) from None
        problem = R._problem(q, point.args, point.cu_values, _Group(n, 0), None)
        exchange, heads, plan, kernel = R._heads_route("ulysses", q, k, k, point.args, problem, False)
        route = R.Route(_Group(n, 0), _Group(n, 0), "ulysses", exchange, heads, plan, kernel, {}, None)
        qs = (1, heads.q.per_rank, n * l_len, d)
        kvs = (1, heads.kv.per_rank, n * l_len, d)
        return [RankJob(route, plan, kernel, qs, kvs, False, plan_work(plan) * heads.q.per_rank, weight=n)]
    if strategy == "hybrid":
        try:
            head_splits(point.hq, point.hkv, u, "hybrid")
        except ValueError as e:
            raise NotApplicable(str(e)) from None
        r_size = n // u
        for ring_rank in range(r_size):
            ring, head = _Group(r_size, ring_rank), _Group(u, 0)
            problem = R._problem(q, point.args, point.cu_values, ring, head)
            exchange, heads, plan, kernel = R._heads_route("hybrid", q, k, k, point.args, problem, False)
            route = R.Route(ring, head, "hybrid", exchange, heads, plan, kernel, {}, None)
            qs = (1, heads.q.per_rank, u * l_len, d)
            kvs = (1, heads.kv.per_rank, u * l_len, d)
            jobs.append(RankJob(route, plan, kernel, qs, kvs, True, plan_work(plan) * heads.q.per_rank, weight=u,
                                rank=ring_rank * u))
        return jobs
    raise ValueError(f"unknown strategy {strategy!r}")


class NotApplicable(Exception):
    """The strategy cannot serve this point (heads, layout): reported, not an error."""


def sampled(jobs: list[RankJob], limit: int) -> list[RankJob]:
    """At most `limit` ranks: the most and least work, the most plan tasks, the first and the last."""
    if not limit or len(jobs) <= limit:
        return jobs
    by_tasks = max(jobs, key=lambda j: (len(_tasks(j.plan)), j.rank))
    picks = [max(jobs, key=lambda j: (j.work, -j.rank)), by_tasks, min(jobs, key=lambda j: (j.work, j.rank)),
             jobs[0], jobs[-1]]
    out = []
    for j in picks:
        if all(j is not o for o in out):
            out.append(j)
    return out[:limit]


def _tasks(plan):
    return [t for p in plan for t in p.tasks] if isinstance(plan, tuple) else list(plan.tasks)


# ---- timing -----------------------------------------------------------------------------------------------

#: a point's timed runs, when they are short: at most this many times --iters (Timer.measure)
SHORT_RUNS_CAP = 8
#: Timer.device_pass's runs per rank (medians)
DEVICE_REPS = 3
#: Timer.steady_pass's runs per rank (medians)
STEADY_REPS = 5


_CYCLES_PER_MS: list = []


def sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU (measured once; also bench_strategies')."""
    if not _CYCLES_PER_MS:
        cycles = 20_000_000
        torch.cuda._sleep(cycles)  # (a first call may be slower)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS.append(cycles / max(a.elapsed_time(b), 1e-3))
    return _CYCLES_PER_MS[0]


class Timer:
    def __init__(self, device: torch.device, warmup: int, iters: int, point_seconds: float):
        self.cuda = device.type == "cuda"
        self.warmup, self.iters, self.point_seconds = max(1, warmup), max(1, iters), point_seconds

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _once(self, fwd: Callable, bwd: Callable) -> tuple[float, float]:
        """(forward ms, forward + backward ms) of one run."""
        if self.cuda:
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            res = fwd()
            b.record()
            bwd(res)
            c.record()
            c.synchronize()
            return a.elapsed_time(b), a.elapsed_time(c)
        t0 = time.perf_counter()
        res = fwd()
        t1 = time.perf_counter()
        bwd(res)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    def measure(self, fwd: Callable, bwd: Callable, first: Callable[[], None]) -> dict:
        """`first()` runs once untimed (counting kernel calls; FA4 compiles there), then cheap runs
        get more warmup, then up to `iters` timed runs (fewer once they add up to point_seconds);
        short runs go on until they add up to point_seconds, up to SHORT_RUNS_CAP x iters runs: a
        pass of a few ms is bound by the host, and its median over 3-7 runs moved by 20-40%
        between two rounds of the same code on one H100 (docs/performance.md)."""
        self._sync()
        t0 = time.perf_counter()
        first()
        self._sync()
        first_s = time.perf_counter() - t0
        if first_s < self.point_seconds:
            for _ in range(self.warmup - 1):
                self._once(fwd, bwd)
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        fwd_ms, tot_ms = [], []
        for _ in range(self.iters * SHORT_RUNS_CAP):
            f, t = self._once(fwd, bwd)
            fwd_ms.append(f)
            tot_ms.append(t)
            if sum(tot_ms) / 1e3 >= self.point_seconds:
                break
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None
        return dict(fwd_ms=statistics.median(fwd_ms), ms=statistics.median(tot_ms), iters=len(tot_ms), peak_mib=peak)

    def device_pass(self, fwd: Callable, bwd: Callable, kernel, reps: int = DEVICE_REPS) -> dict:
        """Where one forward + backward's time goes, median of `reps` runs (after `measure`):

          device_ms  the pass on the device alone: it is queued behind a GPU sleep long enough for
                     the host to queue all of it, so host gaps do not count (a model's other layers
                     keep the device busy the same way while the host runs ahead)
          host_ms    the host's time to queue the pass (its Python, dtcp's tensor ops, FA4's)
          kernel_ms  the attention kernel calls' own device time (events around each call)

        device_ms - kernel_ms is the rest of the device time (dtcp's merges, adds, copies and fills).
        A pass whose host_ms exceeds its device_ms is bound by the host. On CPU all three are wall
        times (kernel_ms: the calls' own)."""
        if not self.cuda:
            rows = []
            for _ in range(reps):
                spent: list = []
                with timing_calls(kernel, spent, cuda=False):
                    t0 = time.perf_counter()
                    bwd(fwd())
                    wall = (time.perf_counter() - t0) * 1e3
                rows.append((wall, wall, sum(spent)))
        else:
            rows, last = [], None
            sleep_ms = None
            for _ in range(reps * 3):
                spent = []
                self._sync()
                if sleep_ms is not None:
                    torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms()))
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                with timing_calls(kernel, spent, cuda=True):
                    t0 = time.perf_counter()
                    bwd(fwd())
                    host = (time.perf_counter() - t0) * 1e3
                b.record()
                b.synchronize()
                last = (a.elapsed_time(b), host, sum(e0.elapsed_time(e1) for e0, e1 in spent))
                if sleep_ms is None or host > 0.8 * sleep_ms:  # (re)size the sleep: 2x the host's time + 2 ms
                    sleep_ms = 2 * host + 2.0
                    continue
                rows.append(last)
                if len(rows) == reps:
                    break
            if not rows:
                # The host never got ahead of a sleep twice its own time: the pass waits for the
                # device (a synchronizing call inside it), so its host time is the sleep's plus
                # its own. Reported as such, with the last run's figures (device_ms then
                # includes the host's gaps).
                return dict(device_ms=last[0], host_ms=last[1], kernel_ms=last[2], host_waits=True)
        dev, host, kern = (statistics.median(col) for col in zip(*rows))
        return dict(device_ms=dev, host_ms=host, kernel_ms=kern)

    def host_split(self, fwd: Callable, bwd: Callable, kernel, host_ms: float, reps: int = DEVICE_REPS) -> dict:
        """How much of the host's time to queue a pass (`host_ms`, Timer.device_pass) is the
        attention kernel's own (its Python, allocations and launches: FA4's interface, for one) and
        how much the rest (dtcp's): the pass again with the kernel's calls replayed from a recorded
        pass (`replaying`), median of `reps` (on CUDA behind a GPU sleep, as device_pass):

          host_rest_ms    its host time without the kernel's calls
          host_kernel_ms  host_ms - host_rest_ms"""
        recorded: list = []
        with replaying(kernel, recorded, record=True):
            bwd(fwd())
        runs = []
        for _ in range(reps):
            self._sync()
            if self.cuda:
                torch.cuda._sleep(int((2 * host_ms + 2.0) * sleep_cycles_per_ms()))
            with replaying(kernel, recorded, record=False):
                t0 = time.perf_counter()
                bwd(fwd())
                runs.append((time.perf_counter() - t0) * 1e3)
        self._sync()
        del recorded
        rest = statistics.median(runs)
        return dict(host_rest_ms=rest, host_kernel_ms=host_ms - rest)

    def steady_pass(self, fwd: Callable, bwd: Callable, kernel, reps: int = STEADY_REPS) -> dict:
        """A pass in the GPU's loaded state, as inside a training loop: queued right behind another
        pass (no synchronisation between them), timed from the end of the one before to its own end
        (CUDA events; median of `reps`, fewer once they add up to point_seconds):

          steady_ms       its device time, plus whatever gaps the host leaves where it queues slower
                          than the device runs (its first launch's latency is hidden behind the pass
                          before, as a model's earlier layers hide it)
          steady_attn_ms  its attention calls' own time (events around each), in the same state

        Why not only Timer.device_pass: its sleep rests the GPU, and at its power cap an H200 runs
        the next 10-60 ms at a higher clock (the one-GPU causal 32K pass: 44.2 ms after a 30 ms
        sleep, 49.1 ms back to back), which favours a rank's short pass over the one device's long
        one; Timer.measure's runs each start from an idle device, so they count the first launch's
        host latency. Also steady_calls_ms: each call's own time, in call order (forward's, then
        backward's). On CPU: the second pass's wall time and its calls' own."""
        if not self.cuda:
            bwd(fwd())
            spent: list = []
            with timing_calls(kernel, spent, cuda=False):
                t0 = time.perf_counter()
                bwd(fwd())
                wall = (time.perf_counter() - t0) * 1e3
            return dict(steady_ms=wall, steady_attn_ms=sum(spent), steady_calls_ms=spent)
        rows = []
        for _ in range(reps):
            self._sync()
            bwd(fwd())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()  # (reached when the pass before ends on the device)
            spent = []
            with timing_calls(kernel, spent, cuda=True):
                bwd(fwd())
            end.record()
            end.synchronize()
            rows.append((start.elapsed_time(end), [e0.elapsed_time(e1) for e0, e1 in spent]))
            if sum(r[0] for r in rows) / 1e3 >= self.point_seconds:  # (a long pass: fewer runs, as Timer.measure)
                break
        calls = [statistics.median(c) for c in zip(*(r[1] for r in rows))] if len({len(r[1]) for r in rows}) == 1 else []
        return dict(steady_ms=statistics.median(r[0] for r in rows),
                    steady_attn_ms=statistics.median(sum(r[1]) for r in rows), steady_calls_ms=calls)


def timing_calls(kernel, spent: list, cuda: bool):
    """While inside, every attention call of `kernel` appends its own time to `spent`: a pair of
    CUDA events (read after a synchronize) or, on CPU, its wall milliseconds. A call made inside
    another (a varlen call looping over dense ones) counts once, in the outer one."""
    depth = [0]

    def timed(method, a, kw):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            res = method(*a, **kw)
            e1.record()
            spent.append((e0, e1))
            return res
        t0 = time.perf_counter()
        res = method(*a, **kw)
        spent.append((time.perf_counter() - t0) * 1e3)
        return res

    def wrap(name, method):
        def wrapper(*a, **kw):
            if depth[0]:
                return method(*a, **kw)
            depth[0] += 1
            try:
                return timed(method, a, kw)
            finally:
                depth[0] -= 1
        return wrapper
    return shadowing(kernel, wrap)


def job_passes(job: RankJob, device, dtype, scale: float) -> tuple[Callable, Callable]:
    """One simulated rank's (forward, backward) through dtcp's executors, on random inputs of its
    shapes: forward() returns what backward(res) takes."""
    g = torch.Generator(device=device).manual_seed(1234 + job.rank)
    q = torch.randn(job.q_shape, device=device, dtype=dtype, generator=g)
    k = torch.randn(job.kv_shape, device=device, dtype=dtype, generator=g)
    v = torch.randn(job.kv_shape, device=device, dtype=dtype, generator=g)
    dout = torch.randn(job.q_shape, device=device, dtype=dtype, generator=g)
    ring = R._has_ring(job.plan)
    comm = NoComm() if ring else None  # (one per rank: the grouped ring's receive buffers stand in once)

    def fwd():
        return R._forward(job.route, job.plan, q, k, v, scale, job.keep, comm, None)

    def bwd(res):
        out, lse, kept = res
        return R._backward(job.route, job.plan, dout, q, k, v, out, lse, scale, kept if job.keep else None, comm)

    return fwd, bwd


def run_job(job: RankJob, device, dtype, timer: Timer, scale: float, profile: bool = False) -> dict:
    """Time one simulated rank: its forward and backward through dtcp's executors. `profile`:
    then print where one forward + backward's device time goes (torch.profiler, top kernels)."""
    fwd, bwd = job_passes(job, device, dtype, scale)
    counts = {"fwd": 0, "bwd": 0}

    def first():
        with counting(job.kernel, counts):
            bwd(fwd())

    with local_collectives():
        res = timer.measure(fwd, bwd, first)
        res.update(timer.device_pass(fwd, bwd, job.kernel))
        res.update(timer.host_split(fwd, bwd, job.kernel, res["host_ms"]))
        res.update(timer.steady_pass(fwd, bwd, job.kernel))
        if profile:
            res["profile"] = profile_once(fwd, bwd, device, f"rank {job.rank} (work {job.work})")
    res.update(launches_fwd=counts["fwd"], launches_bwd=counts["bwd"], rank=job.rank, weight=job.weight, work=job.work,
               launch_work=launch_work(job, device))
    return res


def launch_work(job: RankJob, device) -> Optional[list[int]]:
    """The work (visible pairs x query heads) of each of a ring rank's kernel calls, in the order
    its pass makes them (each direction): its one-launch steps' launches (exec/fused.py), or its
    tasks where it runs task by task. None for other plans, grouped steps or several batch rows."""
    plan = job.plan
    if not isinstance(plan, RingPlan) or job.route.steps_per_launch != 1 or job.q_shape[0] != 1:
        return None
    heads = job.q_shape[1]
    fused = fused_steps(plan, job.kernel, device)
    if fused is None:
        return [plan_pairs([task]) * heads for step in plan.steps for task in step.tasks]
    return [li.launch.pairs * heads for site in fused for li in site]


def profile_once(fwd: Callable, bwd: Callable, device, what: str, rows: int = 14) -> str:
    """One forward + backward under torch.profiler: the kernels that take the device's time, and
    the wall time of the same pass against its device time (where they differ, the host bounds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # (verbose: each op's event carries its Python stack; on CUDA its parents may not be frames)
        from torch._C._profiler import _ExperimentalConfig
        stacks = dict(with_stack=True, experimental_config=_ExperimentalConfig(verbose=True))
    except ImportError:
        stacks = dict(with_stack=True)
    with profile(activities=activities, **stacks) as prof:
        bwd(fwd())
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    bwd(fwd())
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    # where the host's time goes (Python functions), for host-bound passes
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    bwd(fwd())
    if device.type == "cuda":
        torch.cuda.synchronize()
    host.disable()
    return (f"   profile of {what}: wall {wall_ms:.3f} ms for forward + backward (unprofiled)\n{table}\n"
            f"{by_dtcp_function(prof.events(), device, rows + 10)}\n{host_table(pstats.Stats(host), rows + 10)}")


def host_table(stats, rows: int) -> str:
    """cProfile's functions by their own time, in microseconds (pstats prints milliseconds at
    best), the device synchronisation left out; and their own time summed by where the code lives
    (the attention kernel's package, Triton's launcher, torch, dtcp, C builtins): under
    cProfile every call costs more, so read the shares, not the sums."""
    own, total = [], {}
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if "synchronize" in func:
            continue
        where = ("flash_attn" if "flash_attn" in path or "cutlass" in path or "tvm_ffi" in path
                 else "triton" if "/triton/" in path else "torch" if "/torch/" in path
                 else "dtcp" if "/dtcp/" in path else "benchmark" if "benchmarks" in path
                 else "builtins" if path == "~" else "other")
        total[where] = total.get(where, 0.0) + tottime
        own.append((tottime, calls, cumtime, f"{'/'.join(path.rsplit('/', 2)[-2:])}:{line}({func})"))
    own.sort(reverse=True)
    body = "\n".join(f"   {t * 1e6:9.1f} {c * 1e6:9.1f} {n:5d}  {name}" for t, n, c, name in own[:rows])
    sums = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(total.items(), key=lambda kv: -kv[1]))
    return (f"   host (cProfile): own time by where the code lives, ms: {sums}\n"
            f"   own µs   cum µs  calls  function\n{body}")


def by_dtcp_function(events, device, rows: int) -> str:
    """The device time of the torch ops a pass issues, summed per (op, the innermost dtcp function
    that issued it, named by its def line): which merge, add, copy or fill the time outside the
    attention kernels goes to. (FA4's and dtcp's Triton kernels are launched outside torch's ops
    and are in the table above.) Needs the profile taken with_stack=True: the Python frames are
    the ops' parents."""
    totals: dict = {}
    for e in events:
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue  # (an op called by another op counts in its caller's total)
        spent = e.device_time_total if device.type == "cuda" else e.cpu_time_total
        if not spent:
            continue
        frames = list(e.stack or ())
        while parent is not None:
            frames.append(parent.name)
            parent = parent.cpu_parent
        line = next((f[f.rindex("dtcp/") + 5:] for f in frames if "dtcp/" in f and ".py(" in f), "(outside dtcp)")
        us, n = totals.get((e.name, line), (0.0, 0))
        totals[(e.name, line)] = (us + spent, n + 1)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:rows]
    body = "\n".join(f"   {us / 1e3:8.3f} ms {n:4d}x  {name:<28} {line}" for (name, line), (us, n) in ranked)
    what = "device" if device.type == "cuda" else "CPU"
    return f"   {what} time of torch ops by the dtcp function that issued them:\n{body}"


# ---- one device, whole sequence ---------------------------------------------------------------------------

def reference_kernel(device, q, k, task: Task, varlen: Optional[tuple], backend: str):
    """FA4 where it serves (CUDA, installed), else dtcp's "auto" (or `backend`) kernel."""
    if device.type == "cuda" and backend == "auto":
        fa4 = KERNELS["fa4"]
        why = fa4.feature_reason(q, None, None, False) or fa4.reject_reason(q, k, [task])
        if why is None and varlen is not None:
            why = fa4.reject_varlen_reason(*varlen)
        if why is None:
            return fa4, None
        fallback_why = why
    else:
        fallback_why = None
    if varlen is not None:
        try:
            return select_kernel(backend, q, k, [task], varlen=varlen), fallback_why
        except ValueError:
            pass
    return select_kernel(backend, q, k, [task]), fallback_why


def reference(case: Case, hq: int, hkv: int, d: int, device, dtype, timer: Timer, backend: str) -> dict:
    """The whole sequence on this device: one dense call (causal, window) or one varlen call over
    the documents."""
    s, scale = case.seq_len, default_scale(d)
    g = torch.Generator(device=device).manual_seed(7)
    lo = None if case.window < 0 else -case.window
    task = Task(0, s, 0, s, lo, 0)
    if case.docs is None:
        q, dout = (torch.randn(1, hq, s, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(1, hkv, s, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        kernel, why = reference_kernel(device, q, k, task, None, backend)

        def fwd():
            return kernel.forward(q, k, v, task.lo, task.hi, scale)

        def bwd(res):
            out, lse = res
            return kernel.backward(dout, q, k, v, out, lse, task.lo, task.hi, scale)
    else:
        q, dout = (torch.randn(s, hq, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(s, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        cu = [0]
        for length in case.docs:
            cu.append(cu[-1] + length)
        seq_lens = [(b - a, b - a) for a, b in zip(cu, cu[1:])]
        window = (-1, 0)
        q4, k4 = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
        doc_tasks = [Task(0, n, 0, n, None, 0) for n in sorted(set(case.docs))]
        kernel, why = reference_kernel(device, q4, k4, doc_tasks[-1], (seq_lens, window), backend)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        longest = max(case.docs)
        seqs = VarlenSeqs(tuple(cu), tuple(cu), cu_t, cu_t, longest, longest)

        def fwd():
            return kernel.varlen_forward(q, k, v, seqs, window, scale)

        def bwd(res):
            out, lse = res
            return kernel.varlen_backward(dout, q, k, v, out, lse, seqs, window, scale)

    counts = {"fwd": 0, "bwd": 0}

    def first():
        with counting(kernel, counts):
            bwd(fwd())

    res = timer.measure(fwd, bwd, first)
    res.update(timer.device_pass(fwd, bwd, kernel))
    res.update(timer.steady_pass(fwd, bwd, kernel))
    res.update(kernel=kernel.name, launches_fwd=counts["fwd"], launches_bwd=counts["bwd"])
    if why is not None:
        res["fa4_unavailable"] = why
    return res


# ---- the auto check ---------------------------------------------------------------------------------------

def auto_pick(point: Point, device, dtype) -> dict:
    """What strategy="auto" picks for this call and the cost model's predictions (dtcp.explain's
    own function). CUDA tensors on CUDA; meta tensors elsewhere (the kernels the cost model
    assumes then are whatever dtcp.explain assumes on meta)."""
    like = device if device.type == "cuda" else torch.device("meta")
    q = torch.empty(1, point.hq, point.local_len, point.head_dim, device=like, dtype=dtype)
    k = torch.empty(1, point.hkv, point.local_len, point.head_dim, device=like, dtype=dtype)
    args = R.CallArgs("", point.args.layout, True, point.args.scale, "auto", point.args.window_left,
                      point.args.window_right, "auto")
    choice, preds = R.explain(q, k, k, args, point.cu_values, point.n, 0)
    return dict(pick=choice, basis=like.type,
                predicted_ms={p.strategy: p.total_s * 1e3 for p in preds},
                predicted_kernel_ms={p.strategy: p.kernel_s * 1e3 for p in preds})


def placed_as_measured(point: Point, measured_work: Optional[list[int]], dtype) -> bool:
    """Whether this checkout places `point`'s tokens as a run did that measured each rank's ring
    work `measured_work` (its "work_per_rank"; None: not recorded, taken as placed alike)."""
    return measured_work is None or [j.work for j in rank_jobs(point, "ring", torch.device("meta"), dtype)] \
        == measured_work


def replay(path: str, min_chunk: Optional[int] = None) -> dict:
    """The cost model of this checkout judged against a grid measured earlier (its JSON): each
    point's pick made anew on meta tensors (no GPU needed), against the measured times."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        results = json.load(f)
    meta = results["meta"]
    scale = float(Fraction(meta["seq_scale"]))
    cases = {c.name: c for c in build_cases(scale)}
    dtype = getattr(torch, meta["dtype"])
    min_chunk = min_chunk or max(1, round(MIN_CHUNK * scale))
    replayed, stale = [], 0
    ring_work = {(p["case"], p["heads"], p["world_size"], p["layout"]): p.get("work_per_rank")
                 for p in results["points"] if p["strategy"] == "ring"}
    # the all-gather as the run had it: grids before the twenty-ninth session gathered whole shards
    with dtcp_config.override(allgather_exchange=meta.get("allgather_exchange", False)):
        for a in results["auto"]:
            if "measured_ms" not in a or a["case"] not in cases:
                continue
            (_, hq, hkv), = parse_heads([a["heads"]])
            point = make_point(cases[a["case"]], a["layout"], hq, hkv, meta["head_dim"], a["world_size"], "auto",
                               min_chunk)
            # A layout that places documents by itself (Balanced) may place them differently in this
            # checkout: its times then belong to another placement, so the point is not replayed.
            if not placed_as_measured(point, ring_work.get((a["case"], a["heads"], a["world_size"], a["layout"])), dtype):
                stale += 1
                continue
            rec = dict(a, **auto_pick(point, torch.device("meta"), dtype))
            one_d = {k: t for k, t in a["measured_ms"].items() if k in ONE_D_STRATEGIES}
            if rec["pick"] in one_d:
                best = min(one_d, key=one_d.get)
                rec.update(best=best, within_5pct=one_d[rec["pick"]] <= 1.05 * one_d[best],
                           pick_over_best=one_d[rec["pick"]] / one_d[best])
                if not rec["within_5pct"]:
                    print(f"   MISS {a['case']} {a['heads']} N={a['world_size']} {a['layout']}: auto -> {rec['pick']} "
                          f"({one_d[rec['pick']]:.2f} ms measured), best {best} ({one_d[best]:.2f} ms); predicted "
                          + ", ".join(f"{k} {v:.2f}" for k, v in rec["predicted_ms"].items()))
            else:
                rec.update(within_5pct=None, note=f"auto's pick {rec['pick']!r} was not measured")
            replayed.append(rec)
    out = dict(results, auto=replayed)
    print(f"replayed {len(replayed)} picks of {path} ({meta.get('device_name')}) with this checkout's cost model"
          + (f"; {stale} left out (this checkout places their documents otherwise)" if stale else ""))
    out["auto_summary"] = dict(auto_summary(out), left_out_placed_otherwise=stale)
    return out


# ---- the run ----------------------------------------------------------------------------------------------

def summarize(jobs_res: list[dict], one_ms: float, one_fwd_ms: float, n: int) -> dict:
    slowest = max(r["ms"] for r in jobs_res)
    slowest_fwd = max(r["fwd_ms"] for r in jobs_res)
    timed_ranks = sum(r["weight"] for r in jobs_res)
    total = sum(r["ms"] * r["weight"] for r in jobs_res) * n / timed_ranks
    works = [r["work"] for r in jobs_res]
    peaks = [r["peak_mib"] for r in jobs_res if r["peak_mib"] is not None]
    return dict(
        slowest_ms=slowest, slowest_fwd_ms=slowest_fwd,
        split=(one_ms / n) / slowest, split_fwd=(one_fwd_ms / n) / slowest_fwd,
        total_work_ratio=total / one_ms, total_work_estimated=timed_ranks < n,
        launches_fwd=[min(r["launches_fwd"] for r in jobs_res), max(r["launches_fwd"] for r in jobs_res)],
        launches_bwd=[min(r["launches_bwd"] for r in jobs_res), max(r["launches_bwd"] for r in jobs_res)],
        max_work=max(works), work_imbalance=max(works) / (sum(works) / len(works)) if sum(works) else 1.0,
        peak_mib=max(peaks) if peaks else None,
    )


def device_summary(jobs_res: list[dict], ref: dict, n: int, total_work: int) -> dict:
    """Where a point's time goes, in the GPU's loaded state (Timer.steady_pass's figures, the one
    device's pass measured alike), for the rank slowest there:

      split_steady       (one device's steady time / N) / that rank's steady time
      attn_efficiency    its attention calls against the one-device pass's on its share of the
                         work (1.0 = as fast per pair as the whole sequence in one call)
      steady_other_ms    its steady time outside the attention calls (merges, adds, copies,
                         fills; and the host's gaps where it queues slower than the device runs)
      launch_efficiency  per launch of that rank (ring, one launch a step): its forward and
                         backward call against the one-device pass's rate, and its share of the
                         work (launch_efficiency below); which launches lose the kernel's rate

    And Timer.device_pass's (behind a GPU sleep: a rested clock, module docstring), for the rank
    slowest there: split_device, kernel_efficiency, other_ms, host_ms (its host time to queue the
    pass), and bound: "sync" where a rank's pass waits for the device (host_waits), "host" where
    the wall-slowest rank's host time exceeds its device time there, else "device"."""
    slow = max(jobs_res, key=lambda r: r["device_ms"])
    wall = max(jobs_res, key=lambda r: r["ms"])
    share = slow["work"] / total_work if total_work else 1.0 / n
    # The one-device pass is one launch (its host time is nothing beside it): its timed runs and its
    # device-alone runs measure the same thing, and the faster of the two is the reference (a long
    # pass run right after its timed runs can meet a clock lowered by the load: on one H100 a 230 ms
    # pass measured 8% slower there).
    one_device = min(ref["ms"], ref["device_ms"])
    ideal_kernel = min(ref["kernel_ms"], ref["ms"]) * share
    out = dict(
        slowest_device_ms=slow["device_ms"], split_device=(one_device / n) / slow["device_ms"],
        device_rank=slow["rank"], kernel_ms=slow["kernel_ms"], other_ms=slow["device_ms"] - slow["kernel_ms"],
        host_ms=slow["host_ms"], host_rest_ms=slow.get("host_rest_ms"),
        kernel_efficiency=ideal_kernel / slow["kernel_ms"] if slow["kernel_ms"] else None,
    )
    steady = ref.get("steady_ms") is not None and all(r.get("steady_ms") is not None for r in jobs_res)
    if steady:
        slow_steady = max(jobs_res, key=lambda r: r["steady_ms"])
        steady_share = slow_steady["work"] / total_work if total_work else 1.0 / n
        ideal_attn = ref["steady_attn_ms"] * steady_share
        out.update(
            steady_ms=slow_steady["steady_ms"], steady_rank=slow_steady["rank"],
            split_steady=(ref["steady_ms"] / n) / slow_steady["steady_ms"],
            steady_attn_ms=slow_steady["steady_attn_ms"],
            steady_other_ms=slow_steady["steady_ms"] - slow_steady["steady_attn_ms"],
            attn_efficiency=ideal_attn / slow_steady["steady_attn_ms"] if slow_steady["steady_attn_ms"] else None,
            launch_efficiency=launch_efficiency(slow_steady, ref, total_work),
        )
    # The host's time to queue the pass against the least the device needs for it (rested). (Not
    # the steady time: where the host bounds, the steady time is the host's pace plus a little.)
    out["bound"] = ("sync" if any(r.get("host_waits") for r in jobs_res)
                    else "host" if wall["host_ms"] > wall["device_ms"] else "device")
    return out


def launch_efficiency(rank: dict, ref: dict, total_work: int) -> Optional[list[list[float]]]:
    """[forward, backward efficiency, share of the whole work] of each of a rank's launches in the
    loaded state: the one device's forward (backward) call time times the launch's share of the
    work, over the launch's own time (1.0 = the whole batch's rate). None unless the rank's calls
    are its launches (launch_work) and the one device's pass is one call each way."""
    work, calls, ref_calls = rank.get("launch_work"), rank.get("steady_calls_ms") or [], ref.get("steady_calls_ms") or []
    if not work or not total_work or len(calls) != 2 * len(work) or len(ref_calls) != 2:
        return None
    out = []
    for w, t_fwd, t_bwd in zip(work, calls[:len(work)], calls[len(work):]):
        share = w / total_work
        out.append([ref_calls[0] * share / t_fwd if t_fwd > 0 else None,
                    ref_calls[1] * share / t_bwd if t_bwd > 0 else None, share])
    return out


def strategy_variants(case: Case, layout_name: str, n: int, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
    """(strategy, U) to run at this point; hybrid once per factorization U x R with 1 < U < N."""
    out = []
    for s in case.strategies:
        if s not in allowed:
            continue
        if s == "hybrid":
            if layout_name != (case.hybrid_layout or case.layouts[0]):
                continue
            out += [("hybrid", u) for u in range(2, n) if n % u == 0]
        else:
            out.append((s, 0))
    return out


def label(strategy: str, u: int, n: int) -> str:
    return f"hybrid {u}x{n // u}" if strategy == "hybrid" else strategy


def parse_heads(items: list[str]) -> list[tuple[str, int, int]]:
    out = []
    for item in items:
        if item in HEAD_PRESETS:
            hq, hkv = HEAD_PRESETS[item]
        else:
            hq, _, hkv = item.partition("/")
            hq, hkv = int(hq), int(hkv or hq)
        out.append((item, hq, hkv))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backend", default="auto", help="the ranks' kernel (as ring_attention's backend=)")
    p.add_argument("--cases", nargs="*", default=None, help="case names (default: all; --quick: the issue's rows)")
    p.add_argument("--world-sizes", nargs="*", type=int, default=None, help="default 2 4 8 16 (--quick: 2 4 8)")
    p.add_argument("--strategies", nargs="*", default=None, help="ring allgather ulysses hybrid (default: all)")
    p.add_argument("--layouts", nargs="*", default=None,
                   help="only these of each case's layouts (zigzag contiguous doczigzag balanced; default: all); "
                        "balanced@<min_chunk>+<hidden_steps or N> adds that Balanced to the document cases")
    p.add_argument("--heads", nargs="*", default=None,
                   help="'gqa' (32/8), 'mha' (32/32) or Hq/Hkv; default: each case's own (gqa and mha, or gqa)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--replay", default=None,
                   help="no runs: judge this checkout's cost model against the measured times of this JSON")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top kernels of the slowest rank, per point")
    p.add_argument("--min-chunk", type=int, default=None,
                   help="Balanced(min_chunk=) (default 512 x --seq-scale, at least 1)")
    p.add_argument("--ring-steps-per-launch", type=_steps_per_launch, default=None,
                   help="dtcp.config.ring_steps_per_launch for the ring (default: the config's; G > 1: the "
                        "received blocks in groups of G, one launch a group; auto: the cost model's G per point)")
    p.add_argument("--ring-groups-in-place", type=int, choices=(0, 1), default=None,
                   help="dtcp.config.ring_groups_in_place (default: the config's; 0: every group packed into one "
                        "launch, 1: read in place where it can be)")
    p.add_argument("--seq-scale", default="1", help="every length times this (a fraction: 1/128 for a CPU smoke run)")
    p.add_argument("--rank-sample", type=int, default=None, help="time at most this many ranks per ring/all-gather "
                                                                 "point (0: all; default: the case's own)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--point-seconds", type=float, default=0.2,
                   help="stop timing a rank once its timed runs add up to this (at least one run)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new point after this long (default: 450, --quick: 220; 0: no limit)")
    p.add_argument("--require-fa4", action="store_true",
                   help="stop at once where FlashAttention-4 does not serve (e.g. a fresh GPU machine without it): "
                        "the reference and the ranks would otherwise run another kernel")
    p.add_argument("--quick", action="store_true", help="the issue's table rows only (ring and Ulysses, N = 2, 4, 8)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write the split ratio against N per case as a PNG here")
    p.add_argument("--plot-from", default=None, help="only make --plot from this JSON (no runs)")
    return p.parse_args(argv)


def _steps_per_launch(value: str):
    return value if value == "auto" else int(value)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replay:
        return replay(args.replay, args.min_chunk)
    if args.plot_from:  # (a stored result is gzipped: benchmarks/results/*.json.gz)
        with (gzip.open(args.plot_from, "rt") if args.plot_from.endswith(".gz") else open(args.plot_from)) as f:
            results = json.load(f)
        results["auto_summary"] = auto_summary(results)
        plot(results, args.plot or os.path.splitext(args.plot_from)[0] + ".png")
        return results
    if args.ring_steps_per_launch is not None:
        dtcp_config.ring_steps_per_launch = args.ring_steps_per_launch
    if args.ring_groups_in_place is not None:
        dtcp_config.ring_groups_in_place = bool(args.ring_groups_in_place)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for the smoke run)")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    scale = float(Fraction(args.seq_scale))
    cases = build_cases(scale)
    # Balanced's shortest cut chunk, scaled with the lengths (so that a smoke run cuts what a full one does)
    min_chunk = args.min_chunk or max(1, round(MIN_CHUNK * scale))
    names = args.cases or (QUICK["cases"] if args.quick else [c.name for c in cases])
    unknown = set(names) - {c.name for c in cases}
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; known: {[c.name for c in cases]}")
    cases = [c for c in cases if c.name in names]
    world_sizes = args.world_sizes or (QUICK["world_sizes"] if args.quick else (2, 4, 8, 16))
    strategies = tuple(args.strategies or (QUICK["strategies"] if args.quick else ("ring", "allgather", "ulysses",
                                                                                    "hybrid")))
    max_seconds = args.max_seconds if args.max_seconds is not None else (220.0 if args.quick else 450.0)
    timer = Timer(device, args.warmup, args.iters, args.point_seconds)
    fa4_status = KERNELS["fa4"].feature_reason(torch.empty(1, 1, 1, args.head_dim, device=device, dtype=dtype),
                                               None, None, False)
    if args.require_fa4 and fa4_status is not None:
        raise SystemExit(f"bench_split: --require-fa4, but fa4 does not serve here: {fa4_status}")
    results = dict(
        meta=dict(device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, dtype=str(dtype).replace("torch.", ""), head_dim=args.head_dim,
                  seq_scale=args.seq_scale, world_sizes=list(world_sizes), strategies=list(strategies),
                  warmup=args.warmup, iters=args.iters, point_seconds=args.point_seconds, quick=args.quick,
                  ring_steps_per_launch=dtcp_config.ring_steps_per_launch,
                  ring_groups_in_place=dtcp_config.ring_groups_in_place,
                  merge_slots_bytes=dtcp_config.merge_slots_bytes,
                  allgather_exchange=dtcp_config.allgather_exchange,
                  fa4=fa4_status or "available", lognormal_fit=dict(zip(("mu", "sigma"), lognormal_fit()))),
        cases=[], points=[], auto=[], errors=[], skipped=[],
    )
    start = time.perf_counter()
    print(f"bench_split: {device} ({results['meta']['device_name']}), {results['meta']['dtype']}, D={args.head_dim}, "
          f"N in {list(world_sizes)}, strategies {list(strategies)}; fa4: {results['meta']['fa4']}")

    for case in cases:
        heads = parse_heads(args.heads or list(case.heads))
        results["cases"].append(dict(name=case.name, mask=case.mask, seq_len=case.seq_len, layouts=list(case.layouts),
                                     window=case.window, num_docs=None if case.docs is None else len(case.docs),
                                     longest_doc=None if case.docs is None else max(case.docs),
                                     docs=None if case.docs is None else list(case.docs), note=case.note))
        for head_name, hq, hkv in heads:
            hlabel = f"{hq}/{hkv}"
            if _over(start, max_seconds):
                _skip(results, case, hlabel, None, "reference", "time limit")
                continue
            try:
                ref = reference(case, hq, hkv, args.head_dim, device, dtype, timer, args.backend)
            except Exception as e:  # noqa: BLE001 - reported, and the next case runs
                _error(results, case, hlabel, None, None, "one device", e)
                _free(device)
                continue
            _free(device)
            results["cases"][-1].setdefault("one_device", {})[hlabel] = ref
            print(f"\n== {case.name} ({case.mask}, S={case.seq_len}"
                  f"{'' if case.docs is None else f', {len(case.docs)} documents, longest {max(case.docs)}'}) "
                  f"heads {hlabel}: one device {ref['kernel']} fwd+bwd {ref['ms']:.2f} ms (fwd {ref['fwd_ms']:.2f}; "
                  f"steady {_num(ref.get('steady_ms'), '.2f')})"
                  f"{'' if 'fa4_unavailable' not in ref else '  [fa4: ' + ref['fa4_unavailable'] + ']'}")
            print(f"   {'N':>3} {'layout':<10} {'strategy':<12} {'kernel':<9} {'split':>6} {'fwd':>6} {'work':>6} "
                  f"{'launches f/b':>14} {'imbal':>6} {'peak MiB':>9} {'slowest ms':>10} | {'steady':>6} "
                  f"{'attn eff':>8} {'other ms':>8} {'host ms':>8} {'w/o kern':>8} bound")
            for n in world_sizes:
                if n < case.min_world:
                    continue
                for layout_name in case_layouts(case, args.layouts):
                    try:
                        point = make_point(case, layout_name, hq, hkv, args.head_dim, n, args.backend, min_chunk)
                    except Exception as e:  # noqa: BLE001
                        _error(results, case, hlabel, n, layout_name, "layout", e)
                        continue
                    measured = {}
                    for strategy, u in strategy_variants(case, layout_name, n, strategies):
                        name = label(strategy, u, n)
                        if _over(start, max_seconds):
                            _skip(results, case, hlabel, n, f"{layout_name} {name}", "time limit")
                            continue
                        rec = dict(case=case.name, mask=case.mask, seq_len=point.local_len * n, heads=hlabel,
                                   world_size=n, layout=layout_name, strategy=name)
                        try:
                            jobs = rank_jobs(point, strategy, device, dtype, u)
                            limit = args.rank_sample if args.rank_sample is not None else case.rank_sample
                            timed = sampled(jobs, limit) if strategy in ("ring", "allgather") else jobs
                            per_rank = []
                            for job in timed:
                                per_rank.append(run_job(job, device, dtype, timer, point.args.scale,
                                                        profile=args.profile))
                            if args.profile:  # the slowest rank's
                                print(max(per_rank, key=lambda r: r["ms"]).pop("profile"))
                                for r in per_rank:
                                    r.pop("profile", None)
                            summary = summarize(per_rank, ref["ms"], ref["fwd_ms"], n)
                            summary["max_work"] = max(j.work for j in jobs)  # over every rank, timed or not
                            works = [j.work for j in jobs]
                            summary["work_imbalance"] = max(works) / (sum(works) / len(works)) if sum(works) else 1.0
                            summary.update(device_summary(per_rank, ref, n, sum(j.work * j.weight for j in jobs)))
                            rec.update(summary, kernel=jobs[0].kernel.name, exchange=jobs[0].route.exchange,
                                       steps_per_launch=jobs[0].route.steps_per_launch,
                                       plan=plan_kind(jobs[0].plan), work_per_rank=[j.work for j in jobs],
                                       ranks=per_rank)
                        except NotApplicable as e:
                            rec.update(not_applicable=str(e))
                            results["points"].append(rec)
                            continue
                        except Exception as e:  # noqa: BLE001
                            _error(results, case, hlabel, n, layout_name, name, e)
                            _free(device)
                            continue
                        results["points"].append(rec)
                        _free(device)
                        if strategy in ONE_D_STRATEGIES:
                            measured[strategy] = rec["slowest_ms"]
                        else:
                            measured[name] = rec["slowest_ms"]
                        lf, lb = rec["launches_fwd"], rec["launches_bwd"]
                        peak = "-" if rec["peak_mib"] is None else f"{rec['peak_mib']:.0f}"
                        print(f"   {n:>3} {layout_name:<10} {name:<12} {rec['kernel']:<9} {rec['split']:>6.3f} "
                              f"{rec['split_fwd']:>6.3f} {rec['total_work_ratio']:>6.3f} "
                              f"{_span(lf) + '/' + _span(lb):>14} {rec['work_imbalance']:>6.3f} {peak:>9} "
                              f"{rec['slowest_ms']:>10.3f} | {_num(rec.get('split_steady')):>6} "
                              f"{_num(rec.get('attn_efficiency')):>8} {_num(rec.get('steady_other_ms')):>8} "
                              f"{rec['host_ms']:>8.3f} {_num(rec.get('host_rest_ms')):>8} "
                              f"{rec['bound']}{' (sampled ranks)' if rec['total_work_estimated'] else ''}"
                              f"{'' if rec.get('steps_per_launch', 1) == 1 else ' G=' + str(rec['steps_per_launch'])}")
                    _auto_check(results, point, measured, device, dtype, case, hlabel, n, layout_name)
            print(f"   [{time.perf_counter() - start:.0f} s so far]")
            _write(results, args.out)  # after every case: a run stopped from outside keeps what it measured

    results["auto_summary"] = auto_summary(results)
    results["meta"]["elapsed_s"] = time.perf_counter() - start
    if results["errors"]:
        print(f"{len(results['errors'])} point(s) FAILED:")
        for e in results["errors"]:
            print(f"  {e['case']} heads {e['heads']} N={e['world_size']} {e['layout']} {e['strategy']}: {e['error']}")
    if results["skipped"]:
        print(f"{len(results['skipped'])} point(s) skipped (--max-seconds {max_seconds:g}):")
        for s in results["skipped"]:
            print(f"  {s['case']} heads {s['heads']} N={s['world_size']} {s['what']}")
    print(f"elapsed {results['meta']['elapsed_s']:.0f} s")
    replays = _kernel_replays()
    if replays:
        results["meta"]["kernel_replay"] = replays
        print(f"kernel replay (dtcp.config.kernel_replay={dtcp_config.kernel_replay}): {replays}")
    results["meta"]["complete"] = True
    if args.out:
        _write(results, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot(results, args.plot)
    return results


def _kernel_replays() -> dict:
    """FA4's calls by how they went (dtcp/kernels/replay.py stats), where FA4 was called: a
    signature recorded anew every pass would show as many "first" and "recorded" as "replayed"."""
    from dtcp.kernels import fa4
    return {name: dict(wrapper.stats) for name, (_, wrapper) in fa4._REPLAYED.items()}


def _kernel_pick(rec: dict, measured: dict) -> Optional[str]:
    """The strategy the cost model's kernel part alone ranks fastest, among the measured ones."""
    kernel_ms = {s: t for s, t in rec.get("predicted_kernel_ms", {}).items() if s in measured}
    return min(kernel_ms, key=kernel_ms.get) if kernel_ms else None


def auto_summary(results: dict) -> dict:
    """How often auto's pick is within 5% of the best measured 1-D strategy, and (what one GPU can
    judge: it measures compute, not communication) how often the cost model's kernel part alone
    picks within 5%. Printed; returned for the JSON."""
    within, kernel_within, ratios = [], [], []
    for a in results["auto"]:
        one_d = {s: t for s, t in a.get("measured_ms", {}).items() if s in ONE_D_STRATEGIES}
        if a.get("within_5pct") is None or not one_d:
            continue
        within.append(a["within_5pct"])
        ratios.append(a["pick_over_best"])
        kp = _kernel_pick(a, one_d)
        if kp is not None:
            kernel_within.append(one_d[kp] <= 1.05 * min(one_d.values()))
    uncounted = len(results["auto"]) - len(within)
    summary = dict(points=len(within), within_5pct=sum(within),
                   fraction=(sum(within) / len(within)) if within else None,
                   worst_pick_over_best=max(ratios) if ratios else None, not_counted=uncounted,
                   kernel_model_within_5pct=sum(kernel_within),
                   kernel_model_fraction=(sum(kernel_within) / len(kernel_within)) if kernel_within else None)
    print(f"\nauto's pick within 5% of the best measured 1-D strategy (slowest rank, fwd+bwd): "
          f"{sum(within)} of {len(within)} points"
          f"{'' if not within else f' ({100 * sum(within) / len(within):.0f}%; target >= 90%)'}"
          f"{'' if not ratios else f', worst pick {max(ratios):.3f}x the best'}"
          f"{'' if not uncounted else f', not counted (pick not measured): {uncounted}'}")
    if kernel_within:
        print(f"  the cost model's kernel part alone (this benchmark measures compute only; auto adds modeled "
              f"communication, which one GPU cannot check): {sum(kernel_within)} of {len(kernel_within)} "
              f"({100 * sum(kernel_within) / len(kernel_within):.0f}%)")
    return summary


def _auto_check(results, point: Point, measured: dict, device, dtype, case, hlabel, n, layout_name) -> None:
    rec = dict(case=case.name, heads=hlabel, world_size=n, layout=layout_name,
               measured_ms=dict(measured))
    try:
        rec.update(auto_pick(point, device, dtype))
    except Exception as e:  # noqa: BLE001
        rec.update(error=f"{type(e).__name__}: {e}", within_5pct=None)
        results["auto"].append(rec)
        print(f"   auto: explain failed: {rec['error']}")
        return
    one_d = {s: t for s, t in measured.items() if s in ONE_D_STRATEGIES}
    if not one_d:
        rec["within_5pct"] = None
    else:
        best = min(one_d, key=one_d.get)
        pick = rec["pick"]
        rec.update(best=best, best_any=min(measured, key=measured.get))
        if pick in one_d:
            rec["within_5pct"] = one_d[pick] <= 1.05 * one_d[best]
            rec["pick_over_best"] = one_d[pick] / one_d[best]
        else:  # (e.g. --strategies without it): not counted either way
            rec.update(within_5pct=None, note=f"auto's pick {pick!r} was not measured here")
    results["auto"].append(rec)
    if rec["within_5pct"] is None and "note" in rec:
        print(f"   {n:>3} {layout_name:<10} auto -> {rec['pick']:<9} (not measured: not counted)")
    elif rec["within_5pct"] is not None:
        kp = _kernel_pick(rec, one_d)
        print(f"   {n:>3} {layout_name:<10} auto -> {rec['pick']:<9} best {rec['best']:<9} "
              f"{'ok' if rec['within_5pct'] else 'MISS'}   (kernel model alone -> {kp})")


def _write(results: dict, path: Optional[str]) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, path)


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _span(lim) -> str:
    return str(lim[0]) if lim[0] == lim[1] else f"{lim[0]}-{lim[1]}"


def _over(start: float, limit: float) -> bool:
    return bool(limit) and time.perf_counter() - start > limit


def _skip(results, case, heads, n, what, why):
    results["skipped"].append(dict(case=case.name, heads=heads, world_size=n, what=what, why=why))


def _error(results, case, heads, n, layout, strategy, e: Exception):
    text = f"{type(e).__name__}: {e}"
    results["errors"].append(dict(case=case.name, heads=heads, world_size=n, layout=layout, strategy=strategy,
                                  error=text, traceback=traceback.format_exc(limit=6)))
    print(f"   ERROR {case.name} heads {heads} N={n} {layout} {strategy}: {text}", file=sys.stderr, flush=True)


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the plot ---------------------------------------------------------------------------------------------

def plot(results: dict, path: str) -> None:
    """Split ratio against N, one panel per case, a line per layout/strategy (solid: the first
    heads configuration, dashed: the second)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib here: make the plot elsewhere with --plot-from <json> --plot {path}")
        return
    points = [p for p in results["points"] if "split" in p]
    cases = list(dict.fromkeys(p["case"] for p in points))
    if not cases:
        print("nothing to plot")
        return
    cols = min(3, len(cases))
    rows = -(-len(cases) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, case in zip(axes.flat, cases):
        mine = [p for p in points if p["case"] == case]
        heads = list(dict.fromkeys(p["heads"] for p in mine))
        lines: dict = {}
        for p in mine:
            key = (p["layout"], p["strategy"].split(" ")[0], p["heads"])
            # hybrid: the best factorization at each N
            cur = lines.setdefault(key, {})
            cur[p["world_size"]] = max(cur.get(p["world_size"], 0.0), p["split"])
        for (layout, strategy, h), by_n in sorted(lines.items()):
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n] for n in ns], marker="o", linestyle="-" if h == heads[0] else "--",
                    label=f"{strategy} / {layout}" + ("" if len(heads) == 1 else f" ({h})"))
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ns = sorted({p["world_size"] for p in mine})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_title(case)
        ax.set_xlabel("N simulated ranks")
        ax.set_ylabel("split = (one device / N) / slowest rank")
        ax.set_ylim(0, min(2.0, max(1.15, 1.05 * max(p["split"] for p in mine))))
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    meta = results.get("meta", {})
    fig.suptitle(f"bench_split: {meta.get('device_name', '')}, {meta.get('dtype', '')}, D={meta.get('head_dim', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
