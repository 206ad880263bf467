"""The failure model: whatever one rank does wrong, every rank raises a clear error within a
bounded time (dtcp.config.timeout_s), never a hang and never a silent wrong answer.

Each case runs on a fresh process group (dtcp's own communicator for it is made with the test's
short timeout), so a group left failed by one test never touches another; the default group stays
healthy throughout (checked)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_in_fresh_pool, run_ranks
from dtcp.kernels import KERNELS
from faults import FailingKernel
from reference import reference_attention, rel_err

T = 3.0  # dtcp.config.timeout_s in these tests


def _call(g, s_local=8, hq=4, hkv=2, d=8, layout="zigzag", is_causal=True, window=None, cu=None, scale=None,
          dtype=torch.float64, backend="auto", seed=0, backward=True):
    n = dist.get_world_size(g)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    q, k, v = (torch.randn(1, h, s_local, d, generator=gen, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    cu_t = None if cu is None else torch.tensor(cu(s_local * n), dtype=torch.int32)
    out = dtcp.ring_attention(q, k, v, g, layout=layout, is_causal=is_causal, enable_gqa=hq != hkv, scale=scale,
                              window_size=window, cu_seqlens=cu_t, backend=backend)
    if backward:
        out.sum().backward()
    return out


def _outcome(fn):
    """(exception class name or "returned", message, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        return "returned", "", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return type(e).__name__, str(e), time.monotonic() - t0


def _exact_call_works(g) -> bool:
    """A matching call after the incident, checked against single-process attention."""
    n = dist.get_world_size(g)
    layout = dtcp.Zigzag()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 8 * n, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    want, _ = reference_attention(q, k, v, is_causal=True)
    out = dtcp.ring_attention(*(layout.shard(t, g, dim=2) for t in (q, k, v)), g, layout=layout, is_causal=True,
                              enable_gqa=True)
    return rel_err(out, layout.shard(want, g, dim=2)) < 1e-10


def _world_healthy() -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


# ---- different arguments on one rank ------------------------------------------------------------------
ONE_RANK_DIFFERS = {
    "sequence length": (dict(s_local=8), dict(s_local=16), "q.shape"),
    "query heads": (dict(hq=4), dict(hq=8), "q.shape"),
    "head dim": (dict(d=8), dict(d=16), "q.shape"),
    "layout": (dict(layout="zigzag"), dict(layout="contiguous"), "layout"),
    "is_causal": (dict(is_causal=True), dict(is_causal=False), "is_causal"),
    "window": (dict(window=None), dict(window=(3, 0)), "window_size"),
    "cu_seqlens values": (dict(cu=lambda s: [0, 5, s]), dict(cu=lambda s: [0, 6, s]), "cu_seqlens"),
    "cu_seqlens on one rank": (dict(cu=None), dict(cu=lambda s: [0, 5, s]), "cu_seqlens"),
    "scale": (dict(scale=None), dict(scale=0.3), "scale"),
    "dtype": (dict(dtype=torch.float64), dict(dtype=torch.float32), "dtype"),
    "backend": (dict(backend="math"), dict(backend="cpu_flash"), "backend"),
}


def one_rank_differs(case: str):
    common, other, field = ONE_RANK_DIFFERS[case]
    n, r = dist.get_world_size(), dist.get_rank()
    with dtcp.config.override(timeout_s=T):
        g = dist.new_group(list(range(n)))
        kwargs = other if r == n - 1 else common
        raised = _outcome(lambda: _call(g, **kwargs))
        after = _exact_call_works(g)
    return {"raised": raised, "after": after, "field": field, "world": _world_healthy()}


@pytest.mark.parametrize("case", list(ONE_RANK_DIFFERS))
def test_one_rank_with_different_arguments(case):
    """Every rank raises PeerMismatchError at once, before any data moves, naming the field; the
    group then still works."""
    for r in run_ranks(2, one_rank_differs, case, timeout=120):
        kind, message, seconds = r["raised"]
        assert kind == "PeerMismatchError", r
        assert r["field"] in message and "rank" in message, r
        assert seconds < 2.0, r
        assert r["after"] and r["world"], r


def test_one_rank_differs_four_ranks():
    for r in run_ranks(4, one_rank_differs, "window", timeout=120):
        assert r["raised"][0] == "PeerMismatchError" and r["raised"][2] < 2.0, r
        assert r["after"] and r["world"], r


def bad_argument_on_one_rank():
    """The last rank passes a bad window (its own ValueError); the others must not wait for it."""
    n, r = dist.get_world_size(), dist.get_rank()
    with dtcp.config.override(timeout_s=T):
        g = dist.new_group(list(range(n)))
        raised = _outcome(lambda: _call(g, window=(-5, 0) if r == n - 1 else None))
        after = _exact_call_works(g)
    return {"raised": raised, "after": after, "world": _world_healthy()}


def test_bad_argument_on_one_rank():
    results = run_ranks(2, bad_argument_on_one_rank, timeout=120)
    assert results[-1]["raised"][0] == "ValueError" and "window_size" in results[-1]["raised"][1], results
    for r in results[:-1]:
        kind, message, seconds = r["raised"]
        assert kind == "PeerFailedError" and "window_size" in message and seconds < 2.0, r
    assert all(r["after"] and r["world"] for r in results), results


# ---- one rank fails inside the ring ---------------------------------------------------------------------
def one_rank_fails_mid_ring(failing_rank: int, at: int):
    n = dist.get_world_size()
    KERNELS["test_failing"] = FailingKernel(failing_rank, at)
    try:
        with dtcp.config.override(timeout_s=T):
            g = dist.new_group(list(range(n)))
            first = _outcome(lambda: _call(g, backend="test_failing", s_local=16))
            second = _outcome(lambda: _call(g, backend="test_failing", s_local=16))  # the group is failed now
    finally:
        del KERNELS["test_failing"]
    return {"first": first, "second": second, "world": _world_healthy()}


@pytest.mark.parametrize("world_size,failing_rank,at", [(2, 1, 2), (4, 2, 1), (4, 0, 3)])
def test_one_rank_fails_mid_ring(world_size, failing_rank, at):
    """The failing rank raises its own error; every other rank raises PeerFailedError or
    PeerTimeoutError within the timeout (plus slack for a chain of waits); later calls on the group
    raise GroupFailedError at once; the default group is untouched."""
    # (a pool of its own: after a failure mid-ring a surviving rank's gloo loop thread can keep
    # spinning on a core for as long as the process lives, which would slow every later test)
    results = run_in_fresh_pool(world_size, one_rank_fails_mid_ring, failing_rank, at, timeout=120)
    for rank, r in enumerate(results):
        kind, message, seconds = r["first"]
        if rank == failing_rank:
            assert kind == "RuntimeError" and "injected" in message, (rank, r)
        else:
            assert kind in ("PeerFailedError", "PeerTimeoutError"), (rank, r)
        assert seconds < 3 * T, (rank, r)
        assert r["second"][0] == "GroupFailedError" and r["second"][2] < 1.0, (rank, r)
        assert "injected" in r["second"][1] or "waited" in r["second"][1] or "failed" in r["second"][1], (rank, r)
        assert r["world"], (rank, r)


# ---- ranks making different calls ------------------------------------------------------------------------
def one_rank_skips_the_call():
    n, r = dist.get_world_size(), dist.get_rank()
    with dtcp.config.override(timeout_s=T):
        g = dist.new_group(list(range(n)))
        if r == n - 1:
            time.sleep(T + 1.0)  # busy elsewhere, never makes the call
            raised = ("skipped", "", 0.0)
        else:
            raised = _outcome(lambda: _call(g))
    return {"raised": raised, "world": _world_healthy()}


def test_one_rank_never_makes_the_call():
    results = run_ranks(2, one_rank_skips_the_call, timeout=120)
    kind, message, seconds = results[0]["raised"]
    assert kind == "PeerTimeoutError" and "ranks [1]" in message, results
    assert T - 0.5 < seconds < 2 * T, results
    assert all(r["world"] for r in results)


def cached_route_against_a_new_one():
    """Both ranks make call A (agreed, cached). Then the last rank makes call B while the others
    repeat A: the cached route skips the agreement, so the bound is the transport's timeout."""
    n, r = dist.get_world_size(), dist.get_rank()
    with dtcp.config.override(timeout_s=T):
        g = dist.new_group(list(range(n)))
        _call(g, layout="contiguous", is_causal=True)
        raised = _outcome(lambda: _call(g, layout="contiguous", is_causal=r != n - 1))
        again = _outcome(lambda: _call(g, layout="contiguous"))
    return {"raised": raised, "again": again, "world": _world_healthy()}


def test_cached_route_against_a_new_one():
    for r in run_in_fresh_pool(2, cached_route_against_a_new_one, timeout=120):  # (as above: a transport timeout)
        kind, _, seconds = r["raised"]
        assert kind in ("PeerFailedError", "PeerTimeoutError"), r
        assert seconds < 3 * T, r
        assert r["again"][0] == "GroupFailedError", r
        assert r["world"], r


def alternating_cached_routes():
    """Calls A and A' (causal / not) are both agreed and cached; then ranks disagree (one makes A,
    the other A'). With dtcp.config.check_every_call every call is agreed again: PeerMismatchError."""
    n, r = dist.get_world_size(), dist.get_rank()
    with dtcp.config.override(timeout_s=T, check_every_call=True):
        g = dist.new_group(list(range(n)))
        _call(g, is_causal=True)
        _call(g, is_causal=False)
        raised = _outcome(lambda: _call(g, is_causal=r == 0))
        after = _exact_call_works(g)
    return {"raised": raised, "after": after}


def test_check_every_call_catches_disagreement_on_cached_routes():
    for r in run_ranks(2, alternating_cached_routes, timeout=120):
        assert r["raised"][0] == "PeerMismatchError" and "is_causal" in r["raised"][1], r
        assert r["after"], r


def test_ops_are_not_captured_in_cuda_graphs():
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    assert tag is not None
    for op in (torch.ops.dtcp.ring_attention_forward.default, torch.ops.dtcp.ring_attention_backward.default):
        assert tag in op.tags, op


# ---- a named kernel chooses the schedule ---------------------------------------------------------------
def named_kernel_and_auto_exchange():
    """Where auto would gather (as on CUDA with small K/V) but the named kernel cannot serve the
    all-gather schedule's non-square causal blocks (cuDNN on GPUs, cpu_flash here), the ring is
    taken; where no schedule serves the kernel, every rank raises before any data moves."""
    from dtcp.exec import route as route_mod

    n = dist.get_world_size()
    saved = route_mod.exchange_candidates
    route_mod.exchange_candidates = lambda requested, *a: ("allgather", "ring") if requested == "auto" else (requested,)
    try:
        g = dist.new_group(list(range(n)))
        dtcp.comm_stats.reset()
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(1, h, 8 * n, 8, generator=gen, dtype=torch.float64) for h in (8, 2, 2))
        want, _ = reference_attention(q, k, v, is_causal=True)
        layout = dtcp.Zigzag()
        local = [layout.shard(t, g, dim=2) for t in (q, k, v)]
        out = dtcp.ring_attention(*local, g, layout=layout, is_causal=True, enable_gqa=True, backend="cpu_flash")
        exchange = route_mod.route_for(*local, route_mod.CallArgs(g.group_name, "zigzag", True, 8 ** -0.5, "cpu_flash",
                                                                  -1, -1, "auto"), None, "test").exchange
        err = rel_err(out, layout.shard(want, g, dim=2))
        dtcp.comm_stats.reset()
        refused = _outcome(lambda: dtcp.ring_attention(*local, g, layout=layout, is_causal=True, enable_gqa=True,
                                                       backend="cpu_flash", window_size=(3, 0)))
        sent = dtcp.comm_stats.kv_bytes_sent
    finally:
        route_mod.exchange_candidates = saved
    return {"exchange": exchange, "err": err, "refused": refused, "sent": sent}


def test_named_kernel_picks_a_schedule_it_can_serve():
    for r in run_ranks(2, named_kernel_and_auto_exchange, timeout=120):
        assert r["exchange"] == "ring" and r["err"] < 1e-10, r
        kind, message, _ = r["refused"]
        assert kind == "ValueError" and "backend='cpu_flash' cannot serve" in message, r
        assert r["sent"] == 0, r  # refused before any data moved


# ---- the agreement's digest of a batch's token ids ----------------------------------------------------
def test_tensor_digest_is_by_value_and_cheap_to_agree_on():
    """`tensor_digest` (the HF block's agreement on the token ids, read every step): equal for equal
    values in any integer dtype or (B, S) / flat shape, different when one id differs, and the
    same with and without numpy on the machine (where numpy is missing it falls back to the text
    form, which must still tell batches apart)."""
    import builtins

    from dtcp.comm.guard import digest, tensor_digest

    ids = torch.randint(0, 150_000, (2, 4096), generator=torch.Generator().manual_seed(0))
    base = tensor_digest(ids)
    assert base.startswith("8192 values, sha1 ")
    assert tensor_digest(ids.to(torch.int32)) == base
    assert tensor_digest(ids.flatten()) == base
    assert tensor_digest(ids.t().contiguous().t()) == base  # non-contiguous storage, same values
    changed = ids.clone()
    changed[1, 4000] += 1
    assert tensor_digest(changed) != base
    swapped = ids.clone()
    swapped[0, [5, 6]] = swapped[0, [6, 5]]
    assert torch.equal(swapped, ids) or tensor_digest(swapped) != base

    real_import = builtins.__import__

    def no_numpy(name, *args, **kwargs):
        if name == "numpy":
            raise ImportError("no numpy here")
        return real_import(name, *args, **kwargs)

    builtins.__import__ = no_numpy
    try:
        text = tensor_digest(ids)
        assert text == digest(ids.flatten().tolist()) and tensor_digest(changed) != text
    finally:
        builtins.__import__ = real_import
