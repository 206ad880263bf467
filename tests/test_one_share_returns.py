"""dK/dV that go home after one hop (plan/ring.py Step.one_share): where a chain has one holder
and that holder's tasks, on every rank, take each key of the block at most once, what goes home
is one kernel share per key. It travels in the kernel's gradient dtype (bf16 under bf16: half the
bytes of float32) and is added in float32 at home, with the same bits as a float32 return. This
is every ring of 2 ranks and every one-round chain of a window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtcp
from dtcp.comm.simulated import SimulatedRing, locked
from dtcp.exec.ring import ring_backward, ring_forward
from dtcp.kernels.math import MathKernel
from dtcp.plan import AttnMask, ring_plans
from sim_ranks import in_token_order, segments_of

PLANS = [  # (layout, world size, local length, causal, window, documents)
    (dtcp.Zigzag(), 2, 16, True, (-1, -1), None),
    (dtcp.Zigzag(), 4, 16, True, (-1, -1), None),
    (dtcp.Contiguous(), 2, 16, True, (-1, -1), None),
    (dtcp.Contiguous(), 2, 16, False, (-1, -1), None),
    (dtcp.Contiguous(), 3, 16, False, (-1, -1), None),
    (dtcp.layout_from_spec("striped:1"), 2, 16, True, (-1, -1), None),
    (dtcp.layout_from_spec("striped:1"), 3, 16, True, (-1, -1), None),
    (dtcp.Contiguous(), 4, 16, True, (5, 0), None),     # one round: one hop
    (dtcp.Contiguous(), 4, 16, True, (20, 0), None),    # two rounds: a chain of two holders
    (dtcp.Contiguous(), 4, 16, False, (5, 5), None),    # a chain each way, one hop each
    (dtcp.Zigzag(), 4, 16, True, (6, 0), None),
    (dtcp.Contiguous(), 3, 16, True, (-1, -1), (20, 2, 14, 12)),
    (dtcp.Balanced((40, 3, 3, 2, 9, 7), min_chunk=1), 4, 16, True, (-1, -1), (40, 3, 3, 2, 9, 7)),
    (dtcp.Balanced((20, 12), min_chunk=1), 2, 16, True, (-1, -1), (20, 12)),
]


def _plans(layout, n, local_len, causal, window, docs):
    mask = AttnMask.make(causal, window, None if docs is None else segments_of(docs))
    return ring_plans(layout, local_len, n, causal, mask)


@pytest.mark.parametrize("case", PLANS, ids=str)
def test_one_share_marks_one_hop_chains_of_one_share_per_key(case):
    """Step.one_share against a brute force: the step's chain has one holder (the steps of its
    direction) and, on every rank, no key of the held block is taken by two of its tasks; the
    same flag at step t on every rank (a return's two ends agree)."""
    plans = _plans(*case)
    n, steps = len(plans), len(plans[0].steps)
    for t in range(1, steps):
        hops = sum(s.shift == plans[0].steps[t].shift for s in plans[0].steps[1:])
        once = True
        for plan in plans:
            taken = torch.zeros(plan.local_len, dtype=torch.int64)
            for task in plan.steps[t].tasks:
                taken[task.k_start:task.k_end] += 1
            once &= bool((taken <= 1).all())
        assert {plan.steps[t].one_share for plan in plans} == {hops == 1 and once}, (case, t)
    assert not any(plan.steps[0].one_share for plan in plans)
    layout, world, _, causal, window, docs = case
    if world == 2 and docs is None:  # every ring of 2 ranks without documents goes home in one hop
        assert all(p.steps[1].one_share for p in plans) or steps == 1


class _Bf16GradsMath(MathKernel):
    """The math kernel returning its gradients in the inputs' dtype, as FA4, flash and cuDNN do."""

    name = "test_bf16_grads"

    def grad_dtype(self, dtype):
        return dtype

    def backward(self, *args, **kwargs):
        return tuple(g.to(args[1].dtype) for g in super().backward(*args, **kwargs))


def _run(case, plans, kernel, dtype):
    layout, n, local_len, causal, window, docs = case
    s = n * local_len
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, h, s, 8, generator=g).to(dtype) for h in (4, 2, 2, 4))
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r)).contiguous()  # noqa: E731
    sent = [0] * n
    kern = locked(kernel)

    def rank_fn(r, comm):
        exchange = comm.exchange

        def counted(send, recv, shift, kind, slot, direct=False):
            if kind == "grad":
                sent[r] += sum(t.numel() * t.element_size() for t in send)
            return exchange(send, recv, shift, kind, slot, direct)
        comm.exchange = counted
        qr, kr, vr, dr = (shard(t, r) for t in (q, k, v, dout))
        out, lse = ring_forward(qr, kr, vr, plans[r], kern, 8 ** -0.5, comm)
        return (out, lse) + ring_backward(dr, qr, kr, vr, out, lse, plans[r], kern, 8 ** -0.5, comm)

    return in_token_order(SimulatedRing(n).run(rank_fn), layout, n), sent


@pytest.mark.parametrize("case", PLANS, ids=str)
@pytest.mark.parametrize("one_launch", [False, True], ids=["tasks", "launches"])
def test_one_share_returns_are_the_same_bits_in_half_the_bytes(case, one_launch, monkeypatch):
    """bf16 on N simulated ranks (the real ring loops, real received data): the ring with its
    one-hop returns in bf16 gives out, lse, dq, dk and dv bit for bit as with every return in
    float32, and sends half the dK/dV bytes where every chain is one hop."""
    monkeypatch.setattr(_Bf16GradsMath, "varlen_one_launch", one_launch)
    plans = _plans(*case)
    float32_returns = tuple(dataclasses.replace(p, steps=tuple(dataclasses.replace(s, one_share=False)
                                                                for s in p.steps)) for p in plans)
    kernel = _Bf16GradsMath()
    got, sent = _run(case, plans, kernel, torch.bfloat16)
    want, sent_float32 = _run(case, float32_returns, kernel, torch.bfloat16)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    one_hop = [p.steps[t].one_share for p in plans for t in p.chain_ends]
    if one_hop and all(one_hop):
        assert sent == [b // 2 for b in sent_float32] and sum(sent) > 0, (sent, sent_float32)
    elif not any(one_hop):
        assert sent == sent_float32
    # The math kernel's gradients come back in float32 (its grad_dtype): they go home in float32.
    _, sent_math = _run(case, plans, MathKernel(), torch.bfloat16)
    assert sent_math == sent_float32


def test_the_cost_model_moves_one_hop_returns_in_the_kernels_dtype():
    """CallShape.ring_dkv_bytes: 2 for bf16 on 2 ranks (one hop), 4 where chains have several
    holders (causal zigzag on 4 ranks), 4 for a kernel whose gradients come back in float32."""
    from dtcp.exec.route import _ring_launch_fields
    from dtcp.kernels import KERNELS

    flash = KERNELS["cpu_flash"]
    for n, want in ((2, 2), (4, 4)):
        plans = ring_plans(dtcp.Zigzag(), 64, n, True)
        q = torch.empty(1, 4, 64, 16, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, 2, 64, 16, dtype=torch.bfloat16, device="meta")
        assert _ring_launch_fields(plans, flash, 1, q, k, k)["ring_dkv_bytes"] == want
        assert _ring_launch_fields(plans, KERNELS["math"], 1, q, k, k)["ring_dkv_bytes"] == 4


def compiled_one_hop_returns(lengths=(64, 64, 96, 96)):
    """On each of 2 gloo ranks: ring_attention in bf16 with cpu_flash (its gradients come back in
    bf16), eager and under torch.compile(fullgraph=True, aot_eager), a new batch every step, the
    local length changing at the third (`lengths`); the dK/dV bytes each pass sends home, against
    the bf16 size of the span the plan returns."""
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from dtcp.comm.stats import STATS

    torch._dynamo.reset()
    counters.clear()
    rank, layout, (b, hq, hkv, d) = dist.get_rank(), dtcp.Zigzag(), (1, 4, 2, 16)

    def attend(q, k, v):
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, backend="cpu_flash",
                                   strategy="ring")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    same, sent, want_bytes = [], [], []
    for step, local_len in enumerate(lengths):
        plan = ring_plans(layout, local_len, 2, True)[rank]
        want_bytes.append(sum(2 * b * hkv * plan.steps[t].span_len * d * 2 for t in plan.chain_ends))
        g = torch.Generator().manual_seed(10 * step + rank)
        leaves = [torch.randn(b, h, local_len, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]
        dout = torch.randn(b, hq, local_len, d, generator=g).to(torch.bfloat16)
        results = []
        for fn in (attend, compiled):
            x = [t.clone().requires_grad_() for t in leaves]
            STATS.reset()
            out = fn(*x)
            out.backward(dout)
            sent.append((STATS.grad_bytes_sent, want_bytes[-1]))
            results.append([out.detach()] + [t.grad for t in x])
        same.append(all(torch.equal(a, c) for a, c in zip(*results)))
    return {"same": same, "sent": sent, "frames": counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values())}


def test_compiled_one_hop_returns_match_eager():
    """fullgraph, aot_eager, 2 ranks, 4 batches whose local length goes from 64 to 96: 0 graph
    breaks, at most one recompile (the new length), out/dq/dk/dv bit for bit as eager, and every
    pass sends its dK/dV home in bf16 (half of float32's bytes)."""
    from dist_harness import run_ranks

    for r in run_ranks(2, compiled_one_hop_returns, timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] <= 2, r
        assert all(r["same"]), r
        assert all(want > 0 and got == want for got, want in r["sent"]), r
        assert len({want for _, want in r["sent"]}) == 2, r  # (the two lengths' spans differ)


class _SameValuesInFloat32(_Bf16GradsMath):
    """_Bf16GradsMath's gradients, the same values held in float32: its shares travel in float32."""

    name = "test_float32_grads"

    def grad_dtype(self, dtype):
        return torch.float32

    def backward(self, *args, **kwargs):
        return tuple(g.float() for g in super().backward(*args, **kwargs))


def through_the_route(strategy: str):
    """On each rank: dtcp.ring_attention in bf16 (zigzag, causal, GQA) through the route, with the
    bf16-gradient kernel and with its float32 twin; the results and the dK/dV bytes sent."""
    import torch.distributed as dist
    from dtcp.comm.stats import STATS
    from dtcp.kernels import KERNELS

    group = None
    if strategy == "hybrid":
        from dist_harness import _hybrid_groups
        group = _hybrid_groups(True)
    layout, n, s = dtcp.Zigzag(), dist.get_world_size(), 128
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(2, h, s, 16, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4)]
    local = [layout.shard(t, group, dim=2) for t in full]
    runs = {}
    for name, kernel in (("test_bf16_grads", _Bf16GradsMath()), ("test_float32_grads", _SameValuesInFloat32())):
        KERNELS[name] = kernel
        x = [t.clone().requires_grad_() for t in local[:3]]
        STATS.reset()
        out = dtcp.ring_attention(*x, group, layout=layout, is_causal=True, enable_gqa=True, backend=name,
                                  strategy=strategy)
        out.backward(local[3])
        runs[name] = ([out.detach()] + [t.grad for t in x], STATS.grad_bytes_sent, STATS.grad_rounds)
    (a, bytes_a, rounds_a), (b, bytes_b, rounds_b) = runs.values()
    return {"same": [torch.equal(x, y) for x, y in zip(a, b)], "bytes": (bytes_a, bytes_b),
            "rounds": (rounds_a, rounds_b)}


@pytest.mark.parametrize("strategy,world", [("ring", 2), ("hybrid", 4)])
def test_one_hop_returns_through_the_route(strategy, world):
    """Through dtcp.ring_attention on gloo ranks: the ring of 2 ranks, and hybrid on a 2x2 mesh
    (Ulysses inside pairs, a ring of 2 across them): a kernel returning bf16 gradients sends its
    one-hop dK/dV home in bf16, half the bytes of its twin that returns the same values in
    float32, and every result is bit for bit the twin's."""
    from dist_harness import run_ranks

    for r in run_ranks(world, through_the_route, strategy, timeout=300):
        assert all(r["same"]), r
        (bf16, float32), (rounds, rounds_float32) = r["bytes"], r["rounds"]
        assert rounds == rounds_float32 >= 1 and bf16 > 0 and 2 * bf16 == float32, r
