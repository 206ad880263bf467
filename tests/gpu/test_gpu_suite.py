"""dtcp on 2 GPUs (NCCL, copy engines): the correctness matrix, a copy-engine stress run, and
failure injection. Each test prints its figures (run with -s to see them)."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_in_fresh_pool, run_ranks
from faults import FailingKernel
from dtcp.kernels import KERNELS
from dtcp.kernels.fa4 import fa4_interface

WORLD = 2


# ---- the correctness matrix -------------------------------------------------------------------------
def matrix(backends, exchanges, seq_len):
    import check_correctness as cc

    args = cc.parse_args(["--seq-len", str(seq_len)])
    device = torch.device("cuda", torch.cuda.current_device())
    rows, failures = cc.run_matrix(args, device, torch.bfloat16, backends, exchanges)
    return {"rows": rows, "failures": failures}


def test_correctness_matrix_both_exchanges():
    """Every backend x exchange x layout x causal x heads case within 1.5x the same kernel's own
    error against float64, on the same rows (benchmarks/check_correctness.py)."""
    r = run_ranks(WORLD, matrix, ["flash", "cudnn"], ["ring", "allgather", "auto"], 4096, pg_backend="nccl",
                  timeout=900)[0]
    ran = [row for row in r["rows"] if not row["refused"]]
    worst = max(max(row["ratio"].values()) for row in ran)
    print(f"\ncorrectness matrix: {sum(row['ok'] for row in ran)} passed, {r['failures']} failed, "
          f"{len(r['rows']) - len(ran)} refused (an explicit exchange the named kernel cannot serve); "
          f"worst ratio to the kernel's own error {worst:.3f}")
    assert r["failures"] == 0, [row for row in r["rows"] if not row["ok"]]
    for row in r["rows"]:
        if row["refused"]:  # only cuDNN's causal blocks under the all-gather schedule are refused
            assert row["backend"] == "cudnn" and row["kv_exchange"] == "allgather" and row["causal"], row


def test_correctness_matrix_fa4():
    """The same matrix with FlashAttention-4 (backend "fa4"), skipped only where flash_attn.cute
    cannot be imported (pip install "dtcp[flash]")."""
    _, why = fa4_interface()
    if why is not None:
        pytest.skip(why)
    r = run_ranks(WORLD, matrix, ["fa4"], ["ring", "allgather", "auto"], 4096, pg_backend="nccl", timeout=900)[0]
    worst = max(max(row["ratio"].values()) for row in r["rows"])
    print(f"\nfa4 correctness matrix: {sum(row['ok'] for row in r['rows'])} passed, {r['failures']} failed, "
          f"{sum(row['refused'] for row in r['rows'])} refused; worst ratio to the kernel's own error {worst:.3f}")
    assert r["failures"] == 0, [row for row in r["rows"] if not row["ok"]]
    assert not any(row["refused"] for row in r["rows"]), "fa4 serves every band of both exchanges"


# ---- copy-engine stress ------------------------------------------------------------------------------
def stress(steps: int, seed: int):
    """Random shapes, layouts, dtypes, masks and chain directions every step, over the copy
    engines; each step against the same ring with the math kernel (fp32 compute, the same
    transport). A corrupted or misrouted block gives errors of order 1."""
    n, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(seed)  # the same choices on every rank
    worst: dict = {}
    skipped = 0
    for step in range(steps):
        layout = rng.choice(["zigzag", "contiguous", "striped:1"])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        b = rng.choice([1, 2])
        hq, hkv = rng.choice([(8, 8), (8, 2), (4, 1)])
        d = rng.choice([64, 128])
        s_local = 16 * rng.randint(2, 64)
        mask = rng.choice(["causal", "full", "window", "two-sided"])
        causal = mask in ("causal", "window")
        window = None
        if mask == "window":
            # (striped:1 with a window is one kernel call per 1-token run: planning, not transport)
            layout = rng.choice(["zigzag", "contiguous"])
            window = (rng.randint(1, s_local * n), 0)
        elif mask == "two-sided":
            layout = "contiguous"  # both chains: blocks travel forward and backward
            window = (rng.randint(1, s_local * n), rng.randint(1, s_local * n))
        g = torch.Generator().manual_seed(1000 + step)
        full = [torch.randn(b, h, s_local * n, d, generator=g) for h in (hq, hkv, hkv, hq)]
        lay = dtcp.layout_from_spec(layout)
        local = [lay.shard(t, dim=2).to("cuda", dtype) for t in full]
        results = {}
        # PyTorch's flash for every mask: cuDNN builds an execution plan per new shape and auto
        # would compile flex for the rare block FlashAttention-2 cannot take, each once per shape,
        # which over 200 random shapes is minutes of planning and no more transport stress.
        fast = "flash"
        try:
            for backend in (fast, "math"):
                leaves = [t.clone().requires_grad_() for t in local[:3]]
                out = dtcp.ring_attention(*leaves, layout=lay, is_causal=causal, enable_gqa=hq != hkv,
                                          window_size=window, backend=backend, strategy="ring")
                out.backward(local[3])
                results[backend] = [out.detach()] + [t.grad for t in leaves]
        except ValueError as e:  # flash cannot serve this window's blocks (every rank raises alike)
            assert "cannot serve" in str(e), e
            skipped += 1
            continue
        for key, got, want in zip(("out", "dq", "dk", "dv"), results[fast], results["math"]):
            e = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
            name = f"{str(dtype).split('.')[-1]} {key}"
            worst[name] = max(worst.get(name, 0.0), e)
    comm = dtcp.comm.state_of(dist.group.WORLD).rings[torch.device("cuda", torch.cuda.current_device())]
    return {"worst": worst, "exchanges": dict(comm.exchanges), "rank": rank, "skipped": skipped, "steps": steps}


def test_copy_engine_stress_200_steps():
    t0 = time.monotonic()
    results = run_ranks(WORLD, stress, 200, 7, pg_backend="nccl", timeout=900)
    seconds = time.monotonic() - t0
    for r in results:
        print(f"\nstress rank {r['rank']}: {seconds:.0f} s, {r['skipped']} of 200 steps refused by flash, "
              f"exchanges by path {r['exchanges']}, worst error vs the "
              "math kernel: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(r["worst"].items())))
        assert r["exchanges"]["copy_engine"] > 0 and r["exchanges"]["p2p"] == 0, r  # 2 ranks: every shift is +-1
        assert r["skipped"] < 40, r
        for name, e in r["worst"].items():
            assert e < (2e-2 if name.startswith("bfloat16") else 4e-3), (name, e)


# ---- failure injection -------------------------------------------------------------------------------
def inject(kind: str, transport: str, timeout_s: float):
    """kind "raise": the last rank raises inside the ring; kind "stall": the last rank never makes
    a call whose route every rank has already agreed on (its peers' GPUs wait for its data)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    KERNELS["test_failing"] = FailingKernel(n - 1, 2 if kind == "raise" else -1)
    layout = dtcp.Zigzag()

    def call(backward=True):
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, h, 4096, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
                   for h in (8, 2, 2))
        out = dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, backend="test_failing",
                                  strategy="ring")
        if backward:
            out.sum().backward()
        torch.cuda.synchronize()

    outcome = {}
    with dtcp.config.override(timeout_s=timeout_s, transport=transport):
        if kind == "stall":
            call()  # agreed and cached on every rank, slots sized
        t0 = time.monotonic()
        try:
            if kind == "stall" and rank == n - 1:
                time.sleep(2 * timeout_s + 5)  # until well after its peers failed the group
                outcome["first"] = ("stayed away", "")
            else:
                call()
                outcome["first"] = ("returned", "")
        except Exception as e:  # noqa: BLE001 - torch's AcceleratorError is a RuntimeError
            outcome["first"] = (type(e).__name__ if not isinstance(e, RuntimeError) or type(e).__name__.startswith("Peer")
                                else "RuntimeError", f"{type(e).__name__}: {str(e)[:300]}")
        outcome["seconds"] = time.monotonic() - t0
        try:
            call(backward=False)
            outcome["second"] = ("returned", "")
        except Exception as e:  # noqa: BLE001
            outcome["second"] = ("GroupFailedError" if type(e).__name__ == "GroupFailedError" else
                                 "RuntimeError" if isinstance(e, RuntimeError) else type(e).__name__, str(e)[:200])
    return {"rank": rank, **outcome}


@pytest.mark.parametrize("kind,transport", [("raise", "ce"), ("stall", "ce"), ("raise", "nccl")])
def test_failure_injection(kind, transport):
    """Every rank raises within the timeout (plus the watchdog's period): the failing rank its own
    error, the others an error from the released GPU wait or the failed group; none hangs. On the
    NCCL transport the stream stopped by dtcp's assertion makes NCCL's own watchdog end the
    process: the rank ends (quickly) instead of raising."""
    timeout_s = 10.0
    t0 = time.monotonic()
    try:
        results = run_in_fresh_pool(WORLD, inject, kind, transport, timeout_s, pg_backend="nccl", timeout=300)
    except AssertionError as e:
        if transport != "nccl" or "died" not in str(e):
            raise
        print(f"\ninjection {kind}/{transport}: {time.monotonic() - t0:.1f} s including the pool's start; "
              + "; ".join(line for line in str(e).splitlines() if "died" in line or "injected" in line))
        assert time.monotonic() - t0 < 120
        return
    for r in results:
        print(f"\ninjection {kind}/{transport} rank {r['rank']}: first {r['first'][0]} after {r['seconds']:.2f} s "
              f"({r['first'][1][:160]}); second call {r['second'][0]} ({r['second'][1][:120]})")
    for r in results:
        if kind == "stall" and r["rank"] == WORLD - 1:
            assert r["second"][0] == "GroupFailedError", r  # its watchdog saw the others' record
            continue
        assert r["first"][0] not in ("returned",), r
        assert r["seconds"] < timeout_s + 5, r
        assert r["second"][0] in ("GroupFailedError", "RuntimeError"), r
