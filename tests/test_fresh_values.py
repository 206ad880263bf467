"""Nothing dtcp keeps can go stale or grow without bound: document boundaries rewritten behind a
tensor's back (a reused loader buffer, writes through .data), buffers rewritten between forward and
backward, a new context-manager block with fresh boundaries every step, process groups destroyed
and created again under the same name, and compile caches keyed on dtcp's source."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_in_fresh_pool, run_ranks
from reference import reference_attention, rel_err, window_doc_mask

KEYS = ("out", "dq", "dk", "dv")


def _inputs(seed, s, b=1, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _reference(q, k, v, dout, cu):
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*ref, is_causal=True, mask=window_doc_mask(q.shape[2], is_causal=True, cu_seqlens=cu))
    out.backward(dout)
    return [out.detach()] + [t.grad for t in ref]


def rewritten_boundaries(path: str):
    """One cu_seqlens tensor whose values change between calls without a version bump: a numpy
    buffer rewritten in place (torch.from_numpy), and writes through .data. Each call must use the
    values it sees; `path` is "fast" (eager fast path), "op" (the custom op) or "compiled"."""
    n = dist.get_world_size()
    s = 8 * n
    layout = dtcp.Contiguous()
    q, k, v, dout = _inputs(1, s)
    buf = np.array([0, s // 2, s], dtype=np.int32)
    cu = torch.from_numpy(buf)

    def attn(*qkv):
        return dtcp.ring_attention(*qkv, layout=layout, is_causal=True, enable_gqa=True, cu_seqlens=cu)

    fn = attn
    if path == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(attn, backend="aot_eager", fullgraph=True)
    errs = []
    with dtcp.config.override(eager_fast_path=path != "op"):
        for values, how in (([0, s // 2, s], None), ([0, 3, s], "numpy"), ([0, s - 5, s], "data"), ([0, 1, s], "numpy")):
            if how == "numpy":
                buf[:] = values
            elif how == "data":
                cu.data.copy_(torch.tensor(values, dtype=torch.int32))
            want = _reference(q, k, v, dout, values)
            local = [layout.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
            out = fn(*local)
            out.backward(layout.shard(dout, dim=2))
            got = [out.detach()] + [t.grad for t in local]
            errs.append(max(rel_err(a, layout.shard(w, dim=2)) for a, w in zip(got, want)))
    return errs


@pytest.mark.parametrize("path", ["fast", "op", "compiled"])
def test_boundaries_rewritten_in_place_are_read_fresh(path):
    for errs in run_ranks(2, rewritten_boundaries, path, timeout=300):
        assert max(errs) < 1e-10, errs


def rewritten_between_forward_and_backward(path: str):
    """The loader rewrites the boundaries buffer after the forward and before the backward: the
    backward must use the forward's mask."""
    n = dist.get_world_size()
    s = 8 * n
    layout = dtcp.Contiguous()
    q, k, v, dout = _inputs(2, s)
    first, second = [0, 5, s], [0, s - 3, s]
    buf = np.array(first, dtype=np.int32)
    cu = torch.from_numpy(buf)
    want = _reference(q, k, v, dout, first)
    local = [layout.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with dtcp.config.override(eager_fast_path=path == "fast"):
        out = dtcp.ring_attention(*local, layout=layout, is_causal=True, enable_gqa=True, cu_seqlens=cu)
        buf[:] = second  # the next batch's boundaries land in the same buffer
        out.backward(layout.shard(dout, dim=2))
    got = [out.detach()] + [t.grad for t in local]
    return max(rel_err(a, layout.shard(w, dim=2)) for a, w in zip(got, want))


@pytest.mark.parametrize("path", ["fast", "op"])
def test_backward_uses_the_forwards_boundaries(path):
    assert max(run_ranks(2, rewritten_between_forward_and_backward, path)) < 1e-10


def fresh_blocks_every_step(steps=50):
    """50 context_parallel blocks, each with fresh cu_seqlens in its ring options (a new document
    structure every batch): the mode cache and the route cache stay bounded, and results exact."""
    from dtcp.comm import state_of
    from dtcp.frontends import context as ctx

    n = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    s = 4 * n
    errs = []
    modes_before = len(ctx._MODES)
    for step in range(steps):
        q, k, v, _ = _inputs(step, s)
        cut = 1 + step % (s - 1)
        cu = torch.tensor([0, cut, s], dtype=torch.int32)
        want = _reference(q, k, v, torch.zeros_like(q), [0, cut, s])[0]
        with dtcp.context_parallel(mesh, [q, k, v], [2, 2, 2], layout=dtcp.Contiguous(), cu_seqlens=cu):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        errs.append(rel_err(out, dtcp.Contiguous().shard(want, mesh, dim=2)))
    routes = len(state_of(mesh.get_group()).routes)
    return {"max_err": max(errs), "modes_added": len(ctx._MODES) - modes_before, "routes": routes}


def test_context_blocks_with_fresh_boundaries_stay_bounded():
    for r in run_ranks(2, fresh_blocks_every_step):
        assert r["max_err"] < 1e-10, r
        assert r["modes_added"] == 0, r  # options holding tensors are never cached
        assert r["routes"] <= 256, r


def route_cache_is_bounded():
    from dtcp.comm import state_of

    n = dist.get_world_size()
    s = 2 * n
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    for i in range(300):  # 300 distinct signatures (scales)
        dtcp.ring_attention(q, q, q, layout="contiguous", scale=0.1 + i * 1e-3)
    return len(state_of(dist.group.WORLD).routes), s


def test_route_cache_is_bounded():
    for routes, _ in run_ranks(2, route_cache_is_bounded):
        assert routes == 256


def route_follows_the_cost_settings():
    """One call signature under other cost settings (what strategy="auto" and the ring's steps per
    launch are chosen by): each is a route of its own, built and agreed anew; the first settings
    again find their route."""
    import dataclasses

    from dtcp.comm import state_of
    from dtcp.exec.route import clear_routes
    from dtcp.plan import MACHINES

    clear_routes()
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)

    def call() -> int:
        dtcp.ring_attention(q, q, q, layout="zigzag", is_causal=True)
        return len(state_of(dist.group.WORLD).routes)

    counts = [call()]
    with dtcp.config.override(cost_objective="device"):
        counts.append(call())
    with dtcp.config.override(cost_machine=dataclasses.replace(MACHINES["h200-nvlink"], latency_s=1e-3)):
        counts.append(call())
    with dtcp.config.override(layer_flops_per_token=1e9):  # ("auto": the step objective, this layer's work)
        counts.append(call())
    with dtcp.config.override(layer_flops_per_token=2e9):
        counts.append(call())
    counts.append(call())
    clear_routes()
    return counts


def test_route_follows_the_cost_settings():
    for counts in run_ranks(2, route_follows_the_cost_settings):
        assert counts == [1, 2, 3, 4, 5, 5], counts


def compiled_under_each_objective():
    """A compiled call traces auto's pick (the traced all-gather where it is chosen): under
    another cost objective it is traced again, and the first objective's graph is reused after."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q = torch.randn(1, 2, 8, 8)
    fn = torch.compile(lambda q, k, v: dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, backend="math"),
                       backend="aot_eager", fullgraph=True)
    graphs = []
    for objective, flops in (("call", None), ("device", None), ("step", 1e9), ("step", 2e9), ("call", None)):
        with dtcp.config.override(cost_objective=objective, layer_flops_per_token=flops):
            fn(q, q, q)
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return graphs


def test_cost_objective_reaches_compiled_graphs():
    for graphs in run_ranks(2, compiled_under_each_objective, timeout=300):
        assert graphs == [1, 2, 3, 4, 4], graphs


# ---- process groups destroyed and created again --------------------------------------------------

def recreated_groups(store_dir: str):
    """The default group torn down and initialised again (on a fresh store each time) comes back
    with the same names: the default group "0" and its first subgroup "1". dtcp must use the new
    groups, exactly, on both. (Torch's own re-creation of a gloo subgroup alone under the same name,
    new_group(use_local_synchronization=True) twice over the same ranks, races on the rendezvous
    keys the first one left in the store, with or without dtcp: not what this tests.)"""
    n, r = dist.get_world_size(), dist.get_rank()
    names, errs = [], []
    for attempt in range(3):
        dist.destroy_process_group()
        store = dist.FileStore(os.path.join(store_dir, f"store{attempt}"), n)
        dist.init_process_group("gloo", store=store, rank=r, world_size=n)
        sub = dist.new_group(list(range(n)))
        names.append((dist.group.WORLD.group_name, sub.group_name))
        for g in (dist.group.WORLD, sub):
            q, k, v, dout = _inputs(attempt, 4 * n)
            want = _reference(q, k, v, dout, None)
            layout = dtcp.Zigzag()
            local = [layout.shard(t, g, dim=2).clone().requires_grad_() for t in (q, k, v)]
            out = dtcp.ring_attention(*local, g, layout=layout, is_causal=True, enable_gqa=True)
            out.backward(layout.shard(dout, g, dim=2))
            got = [out.detach()] + [t.grad for t in local]
            errs.append(max(rel_err(a, layout.shard(w, g, dim=2)) for a, w in zip(got, want)))
    return {"names": names, "errs": errs}


def test_groups_destroyed_and_created_again(tmp_path):
    for r in run_in_fresh_pool(2, recreated_groups, str(tmp_path), timeout=300):
        assert len(set(r["names"])) == 1, r  # the same group names every time
        assert max(r["errs"]) < 1e-10, r


def released_before_exit(store_dir: str):
    """dtcp's own groups (made on its first call over a group) outlive the caller's destroyed
    group only until the exit release, which runs at interpreter exit (atexit), not at
    finalization: a gloo backend torn down while the interpreter finalizes can abort the process."""
    import weakref

    from dtcp.comm import groups

    n, r = dist.get_world_size(), dist.get_rank()
    sub = dist.new_group(list(range(n)))
    for g in (dist.group.WORLD, sub):
        q, k, v, dout = _inputs(0, 4 * n)
        layout = dtcp.Zigzag()
        local = [layout.shard(t, g, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = dtcp.ring_attention(*local, g, layout=layout, is_causal=True, enable_gqa=True)
        out.backward(layout.shard(dout, g, dim=2))
    own = [weakref.ref(g) for _, _, g in groups._OWN_GROUPS]
    del sub, g, out
    dist.destroy_process_group()
    alive_after_destroy = sum(ref() is not None for ref in own)
    groups.release_at_exit()
    alive_after_release = sum(ref() is not None for ref in own)
    # (a world again, for the next test in this pool, and dtcp serves it)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), n), rank=r, world_size=n)
    q, k, v, dout = _inputs(1, 4 * n)
    layout = dtcp.Zigzag()
    local = [layout.shard(t, None, dim=2) for t in (q, k, v)]
    err = rel_err(dtcp.ring_attention(*local, layout=layout, is_causal=True, enable_gqa=True),
                  layout.shard(_reference(q, k, v, dout, None)[0], None, dim=2))
    return len(own), alive_after_destroy, alive_after_release, err


def test_own_groups_released_before_exit(tmp_path):
    for made, after_destroy, after_release, err in run_in_fresh_pool(2, released_before_exit, str(tmp_path),
                                                                      timeout=300):
        assert made == 2, made  # one of dtcp's own per caller's group
        assert after_destroy == 2, after_destroy  # (what the release is for: dtcp still held them)
        assert after_release == 0, after_release
        assert err < 1e-10, err


# ---- compile caches ---------------------------------------------------------------------------------

def test_route_key_follows_the_source(tmp_path):
    """The compiled route key carries a digest of dtcp's source: a changed file changes it."""
    from dtcp import ops

    root = os.path.dirname(os.path.abspath(dtcp.__file__))
    copy = tmp_path / "dtcp"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert ops._source_digest(str(copy)) == ops.SOURCE_DIGEST
    with open(copy / "exec" / "traced.py", "a") as f:
        f.write("\n# a change\n")
    assert ops._source_digest(str(copy)) != ops.SOURCE_DIGEST
    assert ops.SOURCE_DIGEST in ops.compiled_route_key()


def route_switch_reaches_inductor_caches():
    """Compile the same function with inductor twice (dynamo reset in between, inductor's and AOT
    autograd's caches left on), once with the traced all-gather and once without: the second
    compile must run the custom op, not the first compile's cached graph."""
    from dtcp import ops

    calls = []
    real_route_for = ops.route_for

    def counting_route_for(q, *args, **kwargs):
        if type(q) is torch.Tensor:  # a run of the custom op, not a trace
            calls.append(1)
        return real_route_for(q, *args, **kwargs)

    q = torch.randn(1, 2, 8, 8)

    def attn(q, k, v):
        return dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, backend="math", strategy="allgather")

    seen = []
    ops.route_for = counting_route_for
    try:
        for traced in (True, False):
            with dtcp.config.override(traced_allgather=traced):
                torch._dynamo.reset()
                calls.clear()
                torch.compile(attn, backend="inductor", fullgraph=True)(q, q, q)
                seen.append(len(calls))
    finally:
        ops.route_for = real_route_for
        torch._dynamo.reset()
    return seen


def test_route_settings_reach_the_compile_caches():
    for traced_calls, op_calls in run_ranks(2, route_switch_reaches_inductor_caches, timeout=600):
        assert traced_calls == 0, traced_calls  # traced: no custom op runs
        assert op_calls >= 1, op_calls  # switched off: the custom op runs, not a cached traced graph


def decomposed_graph_carries_the_route_key():
    """Inductor's FX-graph cache keys on the graph after dtcp::ring_attention decomposes: the
    custom op call left there must carry the route key (the source digest), or a graph compiled by
    an older dtcp (another op schema, the same positional values) would be reused."""
    from torch._dynamo.backends.common import aot_autograd

    from dtcp import ops

    codes = []

    def capture(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, strategy="ring"),
                       backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn(q, k, v).sum().backward()
    torch._dynamo.reset()
    return {"fw_has_key": ops.SOURCE_DIGEST in codes[0], "bw_has_key": ops.SOURCE_DIGEST in codes[-1],
            "has_op": "ring_attention_forward" in codes[0], "graphs": len(codes)}


def test_decomposed_graph_carries_the_route_key():
    for r in run_ranks(2, decomposed_graph_carries_the_route_key, timeout=300):
        assert r == {"fw_has_key": True, "bw_has_key": True, "has_op": True, "graphs": 2}, r
