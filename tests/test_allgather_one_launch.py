"""The traced all-gather as one varlen launch (dtcp.exec.traced.allgather_attention_traced_one_launch).

On GPUs the launch is PyTorch's flash varlen kernel (run on H200s: benchmarks/bench_traced_one_launch.py);
here a float64 reference varlen function with the same interface stands in for it, so that
everything around the kernel (which keys each packed sequence holds, the cumulative lengths, the
output and lse layouts, the gradients through the gather, compiled and eager) is checked on CPU
against single-process attention to 1e-10."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from dtcp.exec import traced as allgather_traced
from dtcp.exec.traced import PackedTasks, allgather_attention_traced_one_launch
from dtcp.layouts import layout_from_spec
from dtcp.plan import allgather_plans
from reference import reference_attention, rel_err

KEYS = ("out", "lse", "dq", "dk", "dv")


# ---- pure Python ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("is_causal", [True, False])
def test_key_slices_list_each_tasks_keys_in_global_order(spec, world_size, is_causal):
    layout = layout_from_spec(spec)
    local_len = 12
    seq_len = local_len * world_size
    # where each global token lives: (rank, position in that rank's shard)
    home = {}
    for r in range(world_size):
        pos = 0
        for a, b in layout.runs(seq_len, world_size, r):
            for g in range(a, b):
                home[g] = (r, pos)
                pos += 1
    for plan in allgather_plans(layout, local_len, world_size, is_causal):
        for t in plan.tasks:
            got = [(rank, i) for rank, lo, hi in plan.key_slices(t.k_start, t.k_end) for i in range(lo, hi)]
            assert got == [home[g] for g in range(t.k_start, t.k_end)], (plan.rank, t)
            slices = plan.key_slices(t.k_start, t.k_end)
            assert all(a[0] != b[0] or a[2] != b[1] for a, b in zip(slices, slices[1:]))  # merged


def test_key_slices_of_a_partial_range():
    plan = allgather_plans(dtcp.Zigzag(), 8, 2, True)[0]  # pieces of 4: global order 0, 2, 3, 1
    assert plan.key_slices(2, 11) == ((0, 2, 4), (1, 0, 7))


@pytest.mark.parametrize("lens", [(5,), (4, 12), (3, 1, 7)])
def test_packed_cu_seqlens(lens):
    packed = PackedTasks(rows=3, q_lens=lens, k_lens=lens, causal=True)
    expect = torch.tensor([0] + list(lens) * 3).cumsum(0).to(torch.int32)
    assert torch.equal(packed.cu_seqlens(lens, "cpu"), expect)


# ---- on ranks ------------------------------------------------------------------------------------

def reference_varlen(q, k, v, packed: PackedTasks, scale):
    """Stands in for flash_varlen_differentiable: q (Tq, Hq, D), k/v (Tk, Hkv, D) -> out (Tq, Hq,
    D), lse (Hq, Tq); causal bottom-right per sequence, as FlashAttention-2's varlen kernel."""
    outs, lses = [], []
    q0 = k0 = 0
    for _ in range(packed.rows):
        for lq, lk in zip(packed.q_lens, packed.k_lens):
            qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk]))
            i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
            mask = (j - i <= lk - lq) if packed.causal else None
            o, lse = reference_attention(qs, ks, vs, scale=scale, mask=mask)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
            q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _inputs(seed, b, hq, hkv, s, d):
    g = torch.Generator().manual_seed(seed)
    # q, k, v as transposed views of (B, S, H, D) projections, as models hand them to attention
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64).transpose(1, 2) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def one_launch_errors(spec, is_causal, hq, hkv):
    """Errors of the one-launch route (reference varlen function) against full attention, on
    this rank's rows, and the packed call's shape."""
    n, rank = dist.get_world_size(), dist.get_rank()
    layout = layout_from_spec(spec)
    b, s, d = 2, 12 * n, 8
    q, k, v, dout = _inputs(5, b, hq, hkv, s, d)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, is_causal=is_causal)
    out_ref.backward(dout)
    shard = lambda t: layout.shard(t, dim=2)  # noqa: E731
    plan = allgather_plans(layout, s // n, n, is_causal)[rank]
    calls = []

    def counting_varlen(q, k, v, packed, scale):
        calls.append((tuple(q.shape), tuple(k.shape), packed))
        return reference_varlen(q, k, v, packed, scale)

    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = allgather_attention_traced_one_launch(*local, dist.group.WORLD, plan, d ** -0.5,
                                                     attention=counting_varlen)
    out.backward(shard(dout))
    got = [out, lse] + [t.grad for t in local]
    want = [shard(out_ref), shard(lse_ref)] + [shard(t.grad) for t in ref]
    (qs, ks, packed), = calls
    return {"errs": dict(zip(KEYS, (rel_err(a, w) for a, w in zip(got, want)))),
            "q_rows": qs[0], "k_rows": ks[0], "seqs": packed.rows * len(packed.q_lens), "tasks": len(plan.tasks)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("spec,is_causal", [("zigzag", True), ("zigzag", False), ("contiguous", True)])
def test_one_launch_exact_float64(world_size, spec, is_causal):
    for rank, r in enumerate(run_ranks(world_size, one_launch_errors, spec, is_causal, 4, 2)):
        assert max(r["errs"].values()) < 1e-10, (rank, r)
        assert r["seqs"] == 2 * r["tasks"]  # one sequence per (row, task), in one call
        assert r["q_rows"] == 2 * 12  # every local query row once


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_one_launch_exact_heads(hq, hkv):
    for r in run_ranks(2, one_launch_errors, "zigzag", True, hq, hkv):
        assert max(r["errs"].values()) < 1e-10, r


def compiled_one_launch_vs_eager(compile_backend):
    """The public call compiled, with the one-launch route switched on for the math kernel (the
    reference varlen function in the flash call's place), against eager (the per-task route
    outside compile): equal, no graph break, one frame; and the graph holds one varlen call."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    n = dist.get_world_size()
    q, k, v, dout = _inputs(7 + dist.get_rank(), 2, 4, 2, 8, 8)
    calls = []

    def counting_varlen(*args):
        calls.append(1)
        return reference_varlen(*args)

    def attn(q, k, v):
        return dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, enable_gqa=True, backend="math",
                                   return_lse=True, strategy="allgather")

    saved = allgather_traced.one_launch_reason, allgather_traced.flash_varlen_differentiable
    allgather_traced.one_launch_reason = lambda plan, kernel, q: None if len(plan.tasks) > 1 else "one task"
    allgather_traced.flash_varlen_differentiable = counting_varlen
    # The patched route is invisible to the op's route key: keep compile caches out of it.
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        for c in no_caches:
            c.__enter__()
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend(compile_backend)
        compiled = torch.compile(attn, backend=counter, fullgraph=True)
        res = []
        for fn in (attn, compiled):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out, lse = fn(*leaves)
            out.backward(dout)
            res.append([out, lse] + [t.grad for t in leaves])
        traced_calls = len(calls)
    finally:
        for c in no_caches:
            c.__exit__(None, None, None)
        allgather_traced.one_launch_reason, allgather_traced.flash_varlen_differentiable = saved
        torch._dynamo.reset()
    return {"err": max(rel_err(a, b) for a, b in zip(*res)), "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values()), "varlen_calls": traced_calls, "n": n}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_launch_compiled_equals_eager(backend):
    for r in run_ranks(2, compiled_one_launch_vs_eager, backend, timeout=600):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["err"] < 1e-12, r
        assert r["varlen_calls"] >= 1, r  # traced through the one-launch route


def test_one_launch_is_flash_on_cuda_only():
    from dtcp.kernels import KERNELS

    class CudaLike:  # what one_launch_reason reads of q
        device = torch.device("cuda")

    plan = allgather_plans(dtcp.Zigzag(), 8, 2, True)[0]
    assert len(plan.tasks) == 2
    q = torch.zeros(1, 2, 8, 8)
    assert allgather_traced.one_launch_reason(plan, KERNELS["flash"], CudaLike()) is None  # flash on CUDA: taken
    assert allgather_traced.one_launch_reason(plan, KERNELS["math"], q) is not None
    assert allgather_traced.one_launch_reason(plan, KERNELS["math"], CudaLike()) is not None
    assert allgather_traced.one_launch_reason(plan, KERNELS["flash"], q) is not None  # a CPU tensor
    with dtcp.config.override(one_launch=False):
        assert allgather_traced.one_launch_reason(plan, KERNELS["flash"], CudaLike()) is not None
    one_task = allgather_plans(dtcp.Contiguous(), 8, 2, True)[0]
    assert len(one_task.tasks) == 1
    assert allgather_traced.one_launch_reason(one_task, KERNELS["flash"], CudaLike()) is not None
