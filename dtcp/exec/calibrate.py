"""`dtcp.calibrate()`: the cost model's constants (dtcp/plan/cost.py `Machine`), measured on the
machine it runs on, in a few seconds: a ring transfer, an all-to-all, a tiny all-to-all (latency),
a device copy, a decoder layer's matmul, every available kernel on a long square causal block,
the kernel that `backend="auto"` picks at two block lengths (the slowdown of short blocks), and
the host time of one varlen launch of each one-launch kernel. dtcp.calibrate (api.py)
then measures each strategy's fixed host cost per call. Every
rank measures; the constants are the slowest rank's (an all-reduce of the times), so that every
rank's model, and so every rank's choice of strategy, is the same.

On CPU (gloo) the figures are measured the same way; strategy="auto" still takes the ring there.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels import AUTO_ORDER, KERNELS, VarlenSeqs, select_kernel
from ..plan import MACHINES, Machine, Task


def timed(fn, device: torch.device, repeats: int, group=None) -> float:
    """Median seconds of one `fn()` called alone, over `repeats` runs after one warm-up: the
    device idle before each call, its time from the call's start (the host queuing it) to the
    device finishing it. On CUDA the ends are events, so the host's wake-up from the
    synchronisation that follows is not counted. With `group` (a collective `fn`), its ranks
    start each call together after a barrier; else a rank would count the time it waits for a
    peer still finishing the call before (benchmarks/bench_strategies.py times a call the same way)."""
    fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return sorted(times)[len(times) // 2]


def timed_back_to_back(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of one `fn()` among `repeats` + 1 calls queued back to back, the first a
    warm-up: the device's time per call when it is kept fed, which is how a ring's transfers and
    kernels run. This is what a rate must be read from. A host synchronisation after each call
    would add the host's wake-up to every figure: on one 2x H200 machine (2026-11-29) that made a
    4 KB all-to-all 0.362 ms and a 64 MiB one no longer, where other machines read 0.034-0.042 ms
    for the 4 KB one. On CUDA, events recorded between the calls; on CPU, the wall time between them."""
    fn()
    if device.type != "cuda":
        stamps = [time.perf_counter()]
        for _ in range(repeats):
            fn()
            stamps.append(time.perf_counter())
        times = [b - a for a, b in zip(stamps, stamps[1:])]
        return sorted(times)[len(times) // 2]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for event in events[1:]:
        fn()
        event.record()
    events[-1].synchronize()
    times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
    return sorted(times)[len(times) // 2]


def slowest(values: list[float], pg, device: torch.device) -> list[float]:
    """Element-wise max over the group's ranks (every rank gets the same numbers)."""
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return t.tolist()


def launch_host_s(kernel, device: torch.device, dtype: torch.dtype = torch.bfloat16, heads: int = 4,
                  head_dim: int = 128, calls: int = 30) -> float:
    """Host seconds of one varlen launch's forward + backward through `kernel` (what a fused ring
    step pays per launch when the device has little work: the launches queue no faster than the
    host issues them). Tiny inputs (two sequences of 128 tokens), `calls` in a row, one
    synchronisation at the end: the wall time per call is the host's."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(256, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    cu = torch.tensor([0, 128, 256], dtype=torch.int32, device=device)
    seqs = VarlenSeqs((0, 128, 256), (0, 128, 256), cu, cu, 128, 128)
    scale = head_dim ** -0.5

    def one():
        out, lse = kernel.varlen_forward(q, k, v, seqs, (-1, 0), scale)
        kernel.varlen_backward(out, q, k, v, out, lse, seqs, (-1, 0), scale)

    one()  # (compiles, where the kernel compiles)
    one()  # (records, where the kernel's wrapper is replayed: dtcp.config.kernel_replay; the timed calls replay)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def calibrate(pg, device: torch.device, dtype: torch.dtype = torch.bfloat16, heads: int = 32, head_dim: int = 128,
              seq_len: int = 8192, transfer_bytes: int = 64 * 2**20, repeats: int = 5,
              name: Optional[str] = None) -> Machine:
    """Measure a `Machine` over process group `pg` on `device` (see the module docstring)."""
    n, rank = dist.get_world_size(pg), dist.get_rank(pg)
    # ring transfer: send to the next rank, receive from the previous one
    send = torch.empty(transfer_bytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    nxt, prv = dist.get_global_rank(pg, (rank + 1) % n), dist.get_global_rank(pg, (rank - 1) % n)

    def ring_step():
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, pg), dist.P2POp(dist.irecv, recv, prv, pg)])
        for w in works:
            w.wait()

    t_p2p = timed_back_to_back(ring_step, device, repeats) if n > 1 else 1.0
    a2a_in = torch.empty(transfer_bytes // n * n, dtype=torch.uint8, device=device)
    a2a_out = torch.empty_like(a2a_in)
    t_a2a = timed_back_to_back(lambda: dist.all_to_all_single(a2a_out, a2a_in, group=pg), device, repeats) if n > 1 else 1.0
    small_in = torch.empty(4096 * n, dtype=torch.uint8, device=device)
    small_out = torch.empty_like(small_in)
    t_small = timed_back_to_back(lambda: dist.all_to_all_single(small_out, small_in, group=pg), device, repeats) if n > 1 else 0.0
    big = torch.empty(transfer_bytes * 4, dtype=torch.uint8, device=device)
    big_copy = torch.empty_like(big)
    t_copy = timed_back_to_back(lambda: big_copy.copy_(big), device, repeats)
    # A decoder layer's matmul (tokens x hidden @ hidden x hidden), for the "step" objective's
    # other work per layer (CallShape.other_flops_per_token). Small on CPU, where it only has to run.
    mm_m, mm_k = (seq_len, 4096) if device.type == "cuda" else (256, 256)
    mm_a = torch.randn(mm_m, mm_k, device=device, dtype=dtype)
    mm_b = torch.randn(mm_k, mm_k, device=device, dtype=dtype)
    t_mm = timed_back_to_back(lambda: torch.mm(mm_a, mm_b), device, repeats)

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    scale = head_dim ** -0.5

    def kernel_time(kernel, q_len: int, lo, hi) -> float:
        """fwd + bwd of one block: q_len queries against seq_len keys, band (lo, hi)."""
        qq = q[:, :, :q_len]

        def step():
            out, lse = kernel.forward(qq, k, v, lo, hi, scale)
            kernel.backward(torch.ones_like(out), qq, k, v, out, lse, lo, hi, scale)

        return timed_back_to_back(step, device, repeats)

    # Each kernel's rate on one long square causal block (the schedules' main work); which kernel
    # serves which schedule is decided per call, so the model needs them all.
    square = Task(0, seq_len, 0, seq_len, None, 0)
    causal_flops = 2.0 * heads * (seq_len * (seq_len + 1) / 2) * 2 * head_dim * 3.5
    names = [name for name in AUTO_ORDER.get(device.type, ()) if name != "math"]
    rates = []
    for kernel_name in names:
        kernel = KERNELS[kernel_name]
        if kernel.feature_reason(q, v, None, False) or kernel.reject_reason(q, k, [square]):
            continue
        try:
            rates.append((kernel_name, kernel_time(kernel, seq_len, None, 0)))
        except Exception:  # noqa: BLE001 - a kernel that fails here is not one to rank with
            continue
    # The slowdown of short query blocks, with the auto kernel on full (unmasked) blocks.
    auto = select_kernel("auto", q, k, [Task(0, seq_len, 0, seq_len)])
    long_q, short_q = seq_len, 512
    t_long, t_short = kernel_time(auto, long_q, None, None), kernel_time(auto, short_q, None, None)
    q_tiny = torch.zeros(1, 1, 64, 64, device=device, dtype=dtype)
    tiny_task = Task(0, 64, 0, 64, None, 0)
    tiny_kernel = select_kernel("auto", q_tiny, q_tiny, [tiny_task])
    tiny = timed_back_to_back(lambda: tiny_kernel.forward(q_tiny, q_tiny, q_tiny, None, 0, 0.125), device, repeats)
    # Host time per varlen launch (forward + backward) of each one-launch kernel: the fused ring's
    # bound when a rank's steps hold little work.
    hosts = []
    for kernel_name in names:
        kernel = KERNELS[kernel_name]
        if not kernel.varlen_one_launch or kernel.feature_reason(q, v, None, False):
            continue
        try:
            hosts.append((kernel_name, launch_host_s(kernel, device, dtype, head_dim=head_dim)))
        except Exception:  # noqa: BLE001 - not measurable here: the shipped figure stays
            continue
    fixed = [t_p2p, t_a2a, t_small, t_copy, t_long, t_short, tiny, t_mm]
    measured = slowest(fixed + [t for _, t in rates] + [t for _, t in hosts], pg, device)
    t_p2p, t_a2a, t_small, t_copy, t_long, t_short, tiny, t_mm = measured[:len(fixed)]
    rest = measured[len(fixed):]
    rates = [(kernel_name, causal_flops / t) for (kernel_name, _), t in zip(rates, rest[:len(rates)])]
    hosts = [(kernel_name, t) for (kernel_name, _), t in zip(hosts, rest[len(rates):])]

    def full_flops(q_len: int) -> float:
        return 2.0 * heads * q_len * seq_len * 2 * head_dim * 3.5

    rate_long, rate_short = full_flops(long_q) / t_long, full_flops(short_q) / t_short
    # rate(q) = peak * q / (q + half): two block lengths give `half` (in rows of `heads` heads)
    ratio = rate_long / rate_short
    half = max(1.0, (ratio - 1) * short_q * long_q / max(1.0, long_q - ratio * short_q)) if ratio > 1 else 1.0
    peak = dict(rates).get(auto.name, rate_long * (long_q + half) / long_q)
    base = MACHINES["h200-nvlink"]
    return Machine(
        name=name or f"calibrated {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} x{n}",
        p2p_bytes_per_s=transfer_bytes / t_p2p if n > 1 else base.p2p_bytes_per_s,
        collective_bytes_per_s=(a2a_in.numel() * (n - 1) / n) / t_a2a if n > 1 else base.collective_bytes_per_s,
        latency_s=t_small,
        kernel_flops_per_s=peak,
        kernel_half_rows=int(half * heads),
        call_overhead_s=tiny,
        memory_bytes_per_s=2 * big.numel() / t_copy,
        kernel_rates=tuple(rates),
        launch_host_s=tuple((dict(base.launch_host_s) | dict(hosts)).items()),
        launch_s=base.launch_s,  # (not measured here yet: the shipped provisional figure)
        matmul_flops_per_s=2.0 * mm_m * mm_k * mm_k / t_mm,
        compute_capability=(tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda"
                            else base.compute_capability),
    )
