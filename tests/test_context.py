"""`dtcp.context_parallel`: the SDPA rewrite (both ways of naming SDPA), buffers sharded and
restored (also when they require grad), errors, and torch.compile with no graph breaks and no
recompiles. Everything is compared with float64 single-process attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa_bound_early

import dtcp
from dist_harness import run_ranks
from reference import reference_attention, rel_err

_MESHES: dict = {}


def mesh_of(shape, names):
    """One DeviceMesh per (shape, names) per rank process (creating one makes new groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def full_inputs(hq, hkv, s, seed=0, b=2, d=8):
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    f64 = dict(dtype=torch.float64, generator=g)
    return (torch.randn(b, hq, s, d, **f64), torch.randn(b, hkv, s, d, **f64),
            torch.randn(b, hkv, s, d, **f64), torch.randn(b, hq, s, d, **f64))


# ---- the rewrite, buffers, gradients ---------------------------------------------------------


def rewrite_matches_reference(layout_spec, is_causal, hq, hkv, two_dim=False):
    """q, k, v are the block's buffers (and require grad): inside they hold shards; SDPA called
    by both names must give this rank's rows of full attention; on exit they hold the full
    values again and their .grad is the full gradient. `two_dim`: a 2x2 CP mesh (hybrid)."""
    n = dist.get_world_size()
    if two_dim:
        full_mesh = mesh_of((2, 2), ("cp_ring", "cp_ulysses"))
        mesh, options = full_mesh, {"mesh_dim": ("cp_ring", "cp_ulysses")}
        dtcp.comm_stats.reset()
    else:
        mesh = full_mesh = mesh_of((n,), ("cp",))
        options = {}
    layout = dtcp.layout_from_spec(layout_spec)
    q, k, v, dout = full_inputs(hq, hkv, 8 * n)
    ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_inputs, is_causal=is_causal)
    ref_out.backward(dout)

    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    for t in (q, k, v):
        t.requires_grad_(True)
    gqa = hq != hkv
    with dtcp.context_parallel(full_mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], layout=layout,
                               **options) as cp:
        assert q.shape[2] == 8 and k.shape[2] == 8, q.shape  # sharded in place
        assert torch.equal(q.detach(), layout.shard(q0, mesh, dim=2))
        assert torch.equal(cp.positions(8 * n), layout.positions(8 * n, mesh))
        out_early = sdpa_bound_early(q, k, v, is_causal=is_causal, enable_gqa=gqa)
        out_attr = F.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal, enable_gqa=gqa)
        out_early.backward(layout.shard(dout, mesh, dim=2))
    assert torch.equal(out_early, out_attr)
    out_full = layout.unshard(out_early.detach(), mesh, dim=2)
    restored = all(torch.equal(a.detach(), b) for a, b in zip((q, k, v), (q0, k0, v0)))
    errs = [rel_err(out_full, ref_out)] + [rel_err(t.grad, r.grad) for t, r in zip((q, k, v), ref_inputs)]
    return {"max_err": max(errs), "restored": restored, "shapes": [tuple(t.shape) for t in (q, k, v)],
            "grad_shapes": [tuple(t.grad.shape) for t in (q, k, v)], "heads_rounds": dtcp.comm_stats.heads_rounds}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped:1", "striped:2"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_rewrite_two_ranks(layout, is_causal):
    for r in run_ranks(2, rewrite_matches_reference, layout, is_causal, 4, 2):
        assert r["restored"] and r["shapes"] == [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)], r
        assert r["grad_shapes"] == r["shapes"], r
        assert r["max_err"] < 1e-10, r


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped:1"])
def test_rewrite_on_a_2x2_mesh_runs_hybrid(layout):
    """mesh_dim=(ring dim, Ulysses dim): buffers sharded over the 4 CP ranks, SDPA runs hybrid
    (heads exchanged), buffers and gradients restored, exact."""
    for r in run_ranks(4, rewrite_matches_reference, layout, True, 4, 2, True):
        assert r["restored"] and r["max_err"] < 1e-10, r
        assert r["grad_shapes"] == r["shapes"] == [(2, 4, 32, 8), (2, 2, 32, 8), (2, 2, 32, 8)], r
        assert r["heads_rounds"] == 6, r  # two SDPA calls (2 all-to-alls each) and one backward (2)


@pytest.mark.parametrize("layout", ["zigzag", "striped:1"])
def test_rewrite_four_ranks(layout):
    for r in run_ranks(4, rewrite_matches_reference, layout, True, 4, 1):  # MQA
        assert r["restored"] and r["max_err"] < 1e-10, r


def buffer_behaviour():
    """no_restore_buffers, a buffer set to require grad inside the block, restore after an
    exception, and SDPA unchanged outside the block."""
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = mesh_of((n,), ("cp",))
    layout = dtcp.Zigzag()
    ids = torch.arange(4 * n).repeat(2, 1)           # (B=2, S)
    labels = torch.arange(4 * n).repeat(2, 1) + 100
    x = torch.arange(4.0 * n, dtype=torch.float64)   # (S,), made to require grad inside
    res = {}
    with dtcp.context_parallel(mesh, [ids, labels, x], [1, 1, 0], {labels}, layout=layout):
        x.requires_grad_(True)
        (x * (rank + 2)).sum().backward()  # d/dx of sum over ranks: each shard's own factor
        labels[:, 0] = -1  # in-place edits inside the block must not leak into the restored value
        ids[:, 0] = -1
    res["ids_restored"] = torch.equal(ids, torch.arange(4 * n).repeat(2, 1))
    res["labels_local"] = torch.equal(labels[:, 1:], layout.shard(torch.arange(4 * n).repeat(2, 1) + 100, mesh, 1)[:, 1:])
    res["x_restored"] = torch.equal(x.detach(), torch.arange(4.0 * n, dtype=torch.float64))
    want = torch.empty(4 * n, dtype=torch.float64)
    for r in range(n):
        want[layout.global_positions(4 * n, n, r)] = r + 2
    res["x_grad"] = torch.equal(x.grad, want)

    # An exception inside the block still restores the buffers and leaves the mode.
    y = torch.arange(4.0 * n)
    try:
        with dtcp.context_parallel(mesh, [y], [0]):
            raise KeyError("boom")
    except KeyError:
        pass
    res["restored_after_error"] = torch.equal(y, torch.arange(4.0 * n))

    # Outside the block SDPA is the local, single-device one again.
    q, k, v, _ = full_inputs(2, 2, 8)
    res["outside"] = rel_err(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             reference_attention(q, k, v, is_causal=True)[0])
    res["outside_early"] = rel_err(sdpa_bound_early(q, k, v), reference_attention(q, k, v)[0])
    return res


def test_buffers_restore_and_grads():
    for r in run_ranks(2, buffer_behaviour):
        assert r["ids_restored"] and r["labels_local"] and r["x_restored"] and r["x_grad"], r
        assert r["restored_after_error"], r
        assert r["outside"] < 1e-12 and r["outside_early"] < 1e-12, r


def error_messages():
    n = dist.get_world_size()
    mesh = mesh_of((n,), ("cp",))
    mesh2 = mesh_of((1, n), ("dp", "cp"))
    q, k, v, _ = full_inputs(2, 2, 4 * n)
    msgs = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)

    def in_block(fn, **kw):
        with dtcp.context_parallel(mesh, **kw):
            fn()

    catch("attn_mask", lambda: in_block(lambda: sdpa_bound_early(q, k, v, attn_mask=torch.ones(4 * n, 4 * n, dtype=torch.bool))))
    catch("dropout", lambda: in_block(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)))
    catch("nd_mesh", lambda: dtcp.context_parallel(mesh2).__enter__())
    catch("bad_mesh_dim", lambda: dtcp.context_parallel(mesh2, mesh_dim="tp").__enter__())
    catch("not_mesh", lambda: dtcp.context_parallel(dist.group.WORLD).__enter__())
    catch("seq_dims_len", lambda: dtcp.context_parallel(mesh, [q, k], [2]).__enter__())
    catch("seq_len", lambda: dtcp.context_parallel(mesh, [torch.zeros(1, 3)], [1]).__enter__())
    catch("seq_dim_range", lambda: dtcp.context_parallel(mesh, [torch.zeros(1, 4)], [2]).__enter__())
    catch("no_restore", lambda: dtcp.context_parallel(mesh, [q], [2], {k}).__enter__())
    # The N-D mesh with mesh_dim works.
    with dtcp.context_parallel(mesh2, [q], [2], mesh_dim="cp"):
        msgs["nd_ok_shape"] = tuple(q.shape)
    return msgs


def test_errors():
    msgs = run_ranks(2, error_messages)[0]
    assert "attn_mask" in msgs["attn_mask"] and "is_causal=True" in msgs["attn_mask"], msgs
    assert "dropout_p=0.0" in msgs["dropout"], msgs
    assert "mesh_dim" in msgs["nd_mesh"] and "mesh_dim" in msgs["bad_mesh_dim"], msgs
    assert "DeviceMesh" in msgs["not_mesh"], msgs
    assert "buffer_seq_dims" in msgs["seq_dims_len"], msgs
    assert "multiple of 4" in msgs["seq_len"] and "buffers[0]" in msgs["seq_len"], msgs
    assert "buffer_seq_dims[0]" in msgs["seq_dim_range"], msgs
    assert "no_restore_buffers" in msgs["no_restore"], msgs
    assert msgs["nd_ok_shape"] == (2, 2, 4, 8), msgs


def functional_helpers():
    n = dist.get_world_size()
    mesh = mesh_of((n,), ("cp",))
    layout = dtcp.Striped(2)
    ids = torch.arange(8 * n).view(1, -1)
    h = torch.randn(1, 8 * n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids_l, h_l = dtcp.shard_buffers(mesh, [ids, h], [1, 1], layout)
    ok = torch.equal(ids_l[0], layout.positions(8 * n, mesh))
    back = dtcp.unshard_buffers(mesh, [ids_l, h_l], [1, 1], layout)
    back2 = dtcp.context_parallel_unshard(mesh, [h_l], [1], layout=layout)
    return ok and torch.equal(back[0], ids) and torch.equal(back[1], h) and torch.equal(back2[0], h)


def test_functional_helpers():
    assert all(run_ranks(2, functional_helpers))


# ---- torch.compile ----------------------------------------------------------------------------


class SDPABlock(torch.nn.Module):
    """Attention written against plain SDPA, one call under each name, as model code has it."""

    def __init__(self, dim=16, hq=4, hkv=2):
        super().__init__()
        self.hq, self.hkv, self.hd = hq, hkv, dim // hq
        self.q = torch.nn.Linear(dim, hq * self.hd, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * hkv * self.hd, bias=False)
        self.o = torch.nn.Linear(hq * self.hd, dim, bias=False)

    def forward(self, x):  # x: (B, S, dim)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.hd).permute(2, 0, 3, 1, 4)
        y = sdpa_bound_early(q, k, v, is_causal=True, enable_gqa=True)
        y = y + F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=0.3, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def compiled_in_block(compile_backend, dtype_name, steps=3):
    """Compile outside the block, enter the block every step: one frame, no graph break, and the
    same loss and gradients as the eager model run on the full sequence in one process."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    dtype = getattr(torch, dtype_name)
    n = dist.get_world_size()
    mesh = mesh_of((n,), ("cp",))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ref = SDPABlock().to(dtype)
    model = SDPABlock().to(dtype)
    model.load_state_dict(ref.state_dict())
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    errs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(2, 8 * n, 16, generator=g, dtype=dtype)
        w = torch.randn(2, 8 * n, 16, generator=g, dtype=dtype)
        ref.zero_grad()
        (ref(x) * w).sum().backward()  # the whole sequence on this one process
        model.zero_grad()
        y_full = ref(x).detach()
        with dtcp.context_parallel(mesh, [x, w], [1, 1]):
            y = compiled(x)
            (y * w).sum().backward()
        errs.append(rel_err(dtcp.unshard_buffers(mesh, [y.detach()], [1])[0], y_full))
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # parameters are replicated over cp: their grads add up
            errs.append(rel_err(grad, p_ref.grad))
    return {"max_err": max(errs), "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values())}


def test_compile_aot_eager_in_block():
    for r in run_ranks(2, compiled_in_block, "aot_eager", "float64", timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r  # one graph, never recompiled
        assert r["max_err"] < 1e-10, r


def test_compile_inductor_in_block():
    for r in run_ranks(2, compiled_in_block, "inductor", "float32", timeout=600):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-5, r  # float32, inductor fuses the projections its own way
