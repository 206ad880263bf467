"""Host time of one FlashAttention-4 call: through its Python wrapper, and replayed from a recording
(dtcp/kernels/replay.py, `dtcp.config.kernel_replay`).

The calls are the ones a ring step makes (dtcp/kernels/fa4.py): a varlen forward into given
results and a varlen backward, on rows views of (B, H, L, D) tensors, over documents; and the
dense causal pair. Each call is timed on the host alone, hot: bursts of calls back to back (no
synchronisation) while the GPU works through a sleep queued ahead, so the launch queue never
blocks the host; the median over bursts of their mean (`--calls` calls in all). The forward's
results are compared bit for bit. "recording" is a signature's second call, which the replay
records (median of single calls): a new document structure is new signatures, so a model pays it
once a batch. The last line is `dtcp.calibrate`'s `launch_host_s` for FA4 (the cost model's host
seconds of a varlen launch pair), through the wrapper and replayed.

    python benchmarks/bench_replay.py            # one CUDA GPU with flash-attn-4
    python benchmarks/bench_replay.py --device cpu --rows 256 --calls 4   # the path only (tests/test_bench_replay.py,
                                                                          # over a CPU stand-in of FA4's interface)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtcp  # noqa: E402
from dtcp.kernels import KERNELS, VarlenSeqs  # noqa: E402
from dtcp.kernels.fa4 import replayed  # noqa: E402

LENGTH, HQ, HKV, D = 4096, 32, 8, 128


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _sleep(device, ms: float, cycles_per_ms: float) -> None:
    """Queue `ms` of GPU sleep ahead of the timed calls (on CPU there is no queue to keep full)."""
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * cycles_per_ms))


def _docs_seqs(lengths, device) -> VarlenSeqs:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = torch.tensor(cu, dtype=torch.int32, device=device)
    return VarlenSeqs(tuple(cu), tuple(cu), t, t, max(lengths), max(lengths))


def _calls(kernel, device, length: int = LENGTH, dtype=torch.bfloat16):
    """(name, callable) pairs; each callable makes one FA4 call on fixed tensors of `length` rows."""
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, HQ, length, D, device=device, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, HKV, length, D, device=device, generator=g, dtype=dtype) for _ in range(2))
    rows = lambda x: x[0].transpose(0, 1)  # noqa: E731  (L, H, D) views, as the ring passes them
    out = torch.empty_like(q)
    lse = torch.empty(1, HQ, length, device=device, dtype=torch.float32)
    scale = D ** -0.5
    cases = []
    short = [64] * 24 + [160] * 15 if length >= 4096 else [length // 64] * 24 + [length // 32] * 15
    for docs_name, lengths in (("8 documents", [length // 8] * 8), ("40 documents", short + [length - sum(short)])):
        seqs = _docs_seqs(lengths, device)
        cases.append((f"varlen forward_into, {docs_name}", lambda s=seqs: kernel.varlen_forward_into(
            rows(q), rows(k), rows(v), s, (-1, 0), scale, rows(out), lse[0])))
        cases.append((f"varlen backward, {docs_name}", lambda s=seqs: kernel.varlen_backward(
            rows(dout), rows(q), rows(k), rows(v), rows(out), lse[0], s, (-1, 0), scale)))
    cases.append(("dense causal forward", lambda: kernel.forward(q, k, v, None, 0, scale)))
    o, l_ = kernel.forward(q, k, v, None, 0, scale)
    cases.append(("dense causal backward", lambda: kernel.backward(dout, q, k, v, o, l_, None, 0, scale)))
    return cases


def host_us(fn, calls: int, cycles_per_ms: float, burst: int = 20, device=torch.device("cuda")) -> float:
    """Host µs a call, hot: bursts of `burst` calls back to back (the host busy throughout, as in a
    ring pass), queued behind a GPU sleep long enough that the launch queue never blocks; the
    median over the bursts of their mean."""
    per_call = []
    for _ in range(max(1, calls // burst)):
        _sync(device)
        _sleep(device, burst * 2, cycles_per_ms)  # (2 ms a call: far more than a call's host time)
        fn()  # (warms the caches after the synchronisation)
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / burst)
    _sync(device)
    return statistics.median(per_call)


def record_us(fn, reps: int, cycles_per_ms: float, device=torch.device("cuda")) -> float:
    """Host µs of a signature's recorded call (its second; a new document structure makes new
    signatures, so a model records once a batch), median over `reps`: every FA4 signature is
    dropped first, so that the next two calls are a first call (through the wrapper) and the
    recording."""
    times = []
    for _ in range(reps):
        for which in ("fwd", "bwd"):
            replayed(which).programs.clear()
        _sync(device)
        _sleep(device, 10, cycles_per_ms)
        fn()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    return statistics.median(times)


def breakdown(cases, calls: int, cycles_per_ms: float, device=torch.device("cuda")) -> None:
    """Each case's replay in parts (median µs over `calls`): signature(), then every step of its
    program (aten ops and compiled launches), then the result."""
    from dtcp._compat import tree_unflatten
    from dtcp.kernels.replay import Program, Replayed, signature

    original = Replayed.__call__
    for name, fn in cases:
        log = []

        def spy(self, *args, **kwargs):
            log.append((self, args, kwargs))
            return original(self, *args, **kwargs)
        Replayed.__call__ = spy
        try:
            fn()
        finally:
            Replayed.__call__ = original
        for w, args, kwargs in log:
            key, tensors = signature(args, kwargs)
            program = w.programs.get(key)
            if type(program) is not Program:
                print(f"  {name}: {w.name}: no program ({program})")
                continue
            parts = {"signature": [], "result": []}
            for _ in range(calls):
                _sync(device)
                _sleep(device, 5, cycles_per_ms)
                t0 = time.perf_counter()
                key, tensors = signature(args, kwargs)
                t1 = time.perf_counter()
                parts["signature"].append((t1 - t0) * 1e6)
                values = tensors + [None] * (program.slots - len(tensors))
                for i, step in enumerate(program.steps):
                    t0 = time.perf_counter()
                    step.run(values)
                    parts.setdefault(i, []).append((time.perf_counter() - t0) * 1e6)
                t0 = time.perf_counter()
                leaves = [values[x.i] if hasattr(x, "i") else x for x in program.result_leaves]
                tree_unflatten(leaves, program.result_tree)
                parts["result"].append((time.perf_counter() - t0) * 1e6)
            _sync(device)
            med = {k: statistics.median(v) for k, v in parts.items()}
            print(f"  {name}: {w.name}: total {sum(med.values()):.1f} us")
            print(f"      signature {med['signature']:.1f}, result {med['result']:.1f}")
            for i, step in enumerate(program.steps):
                what = f"launch {type(step.fn).__name__}" if step.is_launch else str(step.fn)
                print(f"      {med[i]:7.1f}  {what}  ({len(step.args) + len(step.kwargs)} args)")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time a replay's parts: the signature, and each op and launch of its program")
    parser.add_argument("--rows", type=int, default=LENGTH, help="rows of each call (a multiple of 64)")
    parser.add_argument("--device", default="cuda",
                        help="cuda; cpu runs the same path (a smoke run: dtcp's fa4 kernel over whatever FA4 "
                             "interface is importable, in float32, without a launch queue to keep full)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = KERNELS["fa4"]
    cycles = 0.0
    if device.type == "cuda":
        from bench_split import sleep_cycles_per_ms
        cycles = sleep_cycles_per_ms()
    name_of_device = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"bench_replay: {name_of_device}, torch {torch.__version__}, {str(dtype).replace('torch.', '')}, "
          f"{args.rows} rows, heads {HQ}/{HKV}, D={D}")
    print(f"{'call':38s} {'wrapper us':>11s} {'recording us':>13s} {'replayed us':>12s} {'saved us':>9s}  "
          "same forward bits")
    rows = []
    for name, fn in _calls(kernel, device, args.rows, dtype):
        with dtcp.config.override(kernel_replay=False):
            fn()
            want = [t.clone() for t in fn()[:2]]  # (forward_into writes into the same tensors every call)
            direct = host_us(fn, args.calls, cycles, burst=min(20, args.calls), device=device)
        for _ in range(3):  # first call, recording, a replay
            got = fn()
        fast = host_us(fn, args.calls, cycles, burst=min(20, args.calls), device=device)
        recording = record_us(fn, max(min(5, args.calls), args.calls // 10), cycles, device=device)
        same = None
        if "forward" in name:
            same = all(torch.equal(a, b) for a, b in ((got[0], want[0]), (got[1], want[1])))
        rows.append(dict(call=name, wrapper_us=direct, recording_us=recording, replayed_us=fast, same_forward_bits=same))
        print(f"{name:38s} {direct:11.1f} {recording:13.1f} {fast:12.1f} {direct - fast:9.1f}  "
              f"{'' if same is None else 'yes' if same else 'NO'}")
    if args.breakdown:
        breakdown(_calls(kernel, device, args.rows, dtype), args.calls, cycles, device)
        import cProfile
        import pstats
        for name, fn in _calls(kernel, device, args.rows, dtype)[:2]:
            prof = cProfile.Profile()
            with dtcp.config.override(kernel_replay=False):
                fn()
                prof.enable()
                for _ in range(20):
                    fn()
                prof.disable()
            _sync(device)
            print(f"  cProfile, 20 calls through the wrapper: {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    from dtcp.exec.calibrate import launch_host_s
    with dtcp.config.override(kernel_replay=False):
        pair_direct = launch_host_s(kernel, device, dtype)
    pair_fast = launch_host_s(kernel, device, dtype)
    print(f"calibrate launch_host_s (fa4 varlen pair): wrapper {pair_direct * 1e6:.0f} us, replayed {pair_fast * 1e6:.0f} us")
    stats = {}
    for which in ("fwd", "bwd"):
        w = replayed(which)
        stats[which] = dict(w.stats)
        print(f"fa4 {which}: {w.stats}; programs {sum(1 for p in w.programs.values() if hasattr(p, 'steps'))}, "
              f"steps per program {[len(p.steps) for p in w.programs.values() if hasattr(p, 'steps')]}"
              + (f"; refused: {w.refusals}" if w.refusals else ""))
    return dict(calls=rows, launch_host_s=dict(wrapper=pair_direct, replayed=pair_fast), stats=stats)


if __name__ == "__main__":
    main()
