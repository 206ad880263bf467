"""DTensor support: q/k/v DTensors reaching SDPA inside `context_parallel` on a 2x2 (tp, cp)
mesh, eager and compiled; dtcp layouts as placements round-tripping through `full_tensor` and
`redistribute`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.functional import scaled_dot_product_attention as sdpa_bound_early

import dtcp
from dist_harness import run_ranks
from reference import reference_attention, rel_err
from test_context import full_inputs, mesh_of


def dtensor_sdpa(layout_spec, tp_placement, compiled):
    """q/k/v DTensors split [tp_placement, layout(dim=2)] on a (tp=2, cp=2) mesh; SDPA inside the
    block returns a DTensor with the same placements whose values and gradients match full
    single-process attention."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    mesh = mesh_of((2, 2), ("tp", "cp"))
    layout = dtcp.layout_from_spec(layout_spec)
    tp = Shard(1) if tp_placement == "shard_heads" else Replicate()
    placements = [tp, type(layout)(**{**layout.__dict__, "dim": 2})]
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")

    def attend(q, k, v):
        return sdpa_bound_early(q, k, v, is_causal=True, enable_gqa=True) + F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    fn = torch.compile(attend, backend=counter, fullgraph=True) if compiled else attend
    errs, same_placements = [], True
    for step in range(3):
        q, k, v, dout = full_inputs(4, 2, 16, seed=step)
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = reference_attention(*ref_in, is_causal=True)[0] + reference_attention(*ref_in)[0]
        ref.backward(dout)
        qd, kd, vd = (dtcp.distribute_tensor(t, mesh, placements).requires_grad_(True) for t in (q, k, v))
        with dtcp.context_parallel(mesh, mesh_dim="cp", layout=layout):
            out = fn(qd, kd, vd)
        same_placements &= isinstance(out, DTensor) and tuple(out.placements) == (tp, Shard(2))
        out_full = dtcp.full_tensor(out, placements)
        (out_full * dout).sum().backward()
        errs.append(rel_err(out_full, ref))
        errs += [rel_err(dtcp.full_tensor(t.grad, placements), r.grad) for t, r in zip((qd, kd, vd), ref_in)]
    return {"max_err": max(errs), "same_placements": same_placements, "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("layout,tp", [("zigzag", "shard_heads"), ("striped:1", "replicate"), ("contiguous", "shard_heads")])
def test_dtensor_qkv_eager(layout, tp):
    for r in run_ranks(4, dtensor_sdpa, layout, tp, False, timeout=300):
        assert r["same_placements"] and r["max_err"] < 1e-10, r


def test_dtensor_qkv_compiled():
    for r in run_ranks(4, dtensor_sdpa, "zigzag", "shard_heads", True, timeout=300):
        assert r["same_placements"] and r["max_err"] < 1e-10, r
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r


def layout_placements_round_trip(layout_spec):
    mesh = mesh_of((2, 2), ("tp", "cp"))
    cp_rank = mesh.get_local_rank("cp")
    layout = dtcp.layout_from_spec(layout_spec)
    placement = type(layout)(**{**layout.__dict__, "dim": 1})
    x = torch.randn(2, 16, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dt = dtcp.distribute_tensor(x, mesh, [Replicate(), placement])
    res = {
        "placements": tuple(dt.placements) == (Replicate(), Shard(1)),
        "local_is_layout_shard": torch.equal(dt.to_local(), x.index_select(1, layout.global_positions(16, 2, cp_rank))),
        "full": torch.equal(dtcp.full_tensor(dt), x),
        "recorded": dtcp.layout_placements(dt) == (Replicate(), placement),
    }
    # Ordinary DTensor ops accept it; pass the placements for a derived tensor. (A batched matmul:
    # torch 2.11's DTensor refuses `3-D @ 2-D` sharded on the sequence dim, which flattens it.)
    eye = torch.eye(6, dtype=torch.float64).expand(2, 6, 6).contiguous()
    y = torch.bmm(torch.nn.functional.gelu(dt * 2 + 1), DTensor.from_local(eye, mesh, [Replicate(), Replicate()]))
    res["op"] = rel_err(dtcp.full_tensor(y, [Replicate(), placement]), torch.nn.functional.gelu(x * 2 + 1)) < 1e-15
    try:
        dtcp.full_tensor(y)
        res["unrecorded_raises"] = False
    except ValueError as e:
        res["unrecorded_raises"] = "placements=" in str(e)
    # Redistribution: to Replicate gives original order; to another layout or mesh dim keeps the tokens.
    rep = dtcp.redistribute(dt, [Replicate(), Replicate()])
    res["to_replicate"] = torch.equal(rep.to_local(), x)
    other = dtcp.Contiguous(dim=1) if layout.spec() != "contiguous" else dtcp.Zigzag(dim=1)
    dt2 = dtcp.redistribute(dt, [Shard(2), other])
    res["to_other_layout"] = torch.equal(dtcp.full_tensor(dt2), x) and torch.equal(
        dt2.to_local(), x.index_select(1, other.global_positions(16, 2, cp_rank)).chunk(2, dim=2)[mesh.get_local_rank("tp")])
    dt3 = dtcp.redistribute(dt, [placement, Replicate()])  # same layout, the other mesh dim
    res["to_other_mesh_dim"] = torch.equal(dtcp.full_tensor(dt3), x)
    back = dtcp.redistribute(dtcp.distribute_tensor(x, mesh, [Replicate(), Replicate()]), [Replicate(), placement])
    res["from_replicate"] = torch.equal(back.to_local(), dt.to_local())
    # Gradients flow through full_tensor to the local shards.
    leaf = dtcp.distribute_tensor(x, mesh, [Replicate(), placement]).requires_grad_(True)
    (dtcp.full_tensor(leaf) * torch.arange(16.0, dtype=torch.float64).view(1, 16, 1)).sum().backward()
    res["grad"] = torch.equal(leaf.grad.to_local()[0, :, 0], layout.global_positions(16, 2, cp_rank).double())
    return res


@pytest.mark.parametrize("layout", ["zigzag", "striped:2", "contiguous"])
def test_layout_placements_round_trip(layout):
    for r in run_ranks(4, layout_placements_round_trip, layout):
        assert all(r.values()), r


def _sdpa_in_block(q, mesh, layout):
    with dtcp.context_parallel(mesh, mesh_dim="cp", layout=layout):
        return F.scaled_dot_product_attention(q, q, q)


def placement_errors():
    mesh = mesh_of((2, 2), ("tp", "cp"))
    x = torch.zeros(2, 16, 6)
    msgs = {}
    for name, fn in {
        "no_dim": lambda: dtcp.distribute_tensor(x, mesh, [Replicate(), dtcp.Zigzag()]),
        "count": lambda: dtcp.distribute_tensor(x, mesh, [dtcp.Zigzag(dim=1)]),
        "double_split": lambda: dtcp.distribute_tensor(x, mesh, [Shard(1), dtcp.Zigzag(dim=1)]),
        "length": lambda: dtcp.distribute_tensor(torch.zeros(2, 6, 6), mesh, [Replicate(), dtcp.Zigzag(dim=1)]),
        "mismatch": lambda: dtcp.full_tensor(dtcp.distribute_tensor(torch.zeros(2, 16, 8), mesh, [Replicate(), dtcp.Zigzag(dim=1)]),
                                             [Replicate(), dtcp.Zigzag(dim=2)]),
        "block_layout": lambda: _sdpa_in_block(
            dtcp.distribute_tensor(torch.zeros(1, 2, 16, 4), mesh, [Replicate(), dtcp.Zigzag(dim=2)]), mesh, dtcp.Striped()),
    }.items():
        try:
            fn()
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)
    return msgs


def test_placement_errors():
    msgs = run_ranks(4, placement_errors)[0]
    assert "Zigzag(dim=1)" in msgs["no_dim"], msgs
    assert "one placement per mesh dim" in msgs["count"], msgs
    assert "only split" in msgs["double_split"], msgs
    assert "multiple of 4" in msgs["length"], msgs
    assert "do not match" in msgs["mismatch"], msgs
    assert "same layout" in msgs["block_layout"], msgs


def dtensor_tp_only_mesh():
    """q/k/v DTensors on the tp sub-mesh only (Shard(1), heads), whose local sequences are the
    block's cp shards: the ring runs over the block's group; placements Shard(3) raise."""
    from torch.distributed.tensor import distribute_tensor

    mesh = mesh_of((2, 2), ("tp", "cp"))
    layout = dtcp.Zigzag()
    q, k, v, _ = full_inputs(4, 2, 16, seed=7)
    ref = reference_attention(q, k, v, is_causal=True)[0]
    qd, kd, vd = (distribute_tensor(layout.shard(t, mesh["cp"], dim=2), mesh["tp"], [Shard(1)]) for t in (q, k, v))
    with dtcp.context_parallel(mesh, mesh_dim="cp", layout=layout):
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        try:
            bad = distribute_tensor(q, mesh["tp"], [Shard(3)])
            F.scaled_dot_product_attention(bad, bad, bad)
            msg = ""
        except ValueError as e:
            msg = str(e)
    full = layout.unshard(out.full_tensor(), mesh["cp"], dim=2)
    return {"err": rel_err(full, ref), "placements": tuple(out.placements) == (Shard(1),), "msg": msg}


def test_dtensor_tp_only_mesh():
    for r in run_ranks(4, dtensor_tp_only_mesh):
        assert r["placements"] and r["err"] < 1e-10, r
        assert "Shard(1) (heads)" in r["msg"], r
