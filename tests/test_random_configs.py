"""Random combinations of everything a call can ask for, each exact in float64 against dense
single-process attention (out, lse, dq, dk, dv, and the sinks' gradient): layout, world size (2, 3, 4, 6),
causal or not, a window of any reach, packed documents with empty and single-token ones, GQA,
a value head dim of its own, softcap, sinks, batch rows, and the strategy. The cases are drawn
from a fixed seed, so every run checks the same ones; each prints its configuration on failure.
A few of them also compiled (fullgraph, aot_eager): equal to eager bit for bit, no graph break.
The hand-picked tests elsewhere cover each feature; this covers how they meet."""

from __future__ import annotations

import random

import pytest

import dtcp
from dist_harness import run_ranks
from test_softcap_sinks import KEYS, errors

LAYOUTS = ["contiguous", "zigzag", "striped:1", "striped:2"]
HEADS = [(4, 2), (2, 2), (3, 1), (4, 1), (6, 3)]


def draw_case(rng: random.Random, n: int) -> dict:
    layout = rng.choice(LAYOUTS)
    s = dtcp.layout_from_spec(layout).multiple(n) * rng.randint(1, 4)
    while s < 2 * n:
        s *= 2
    is_causal = rng.random() < 0.6
    window = None
    if rng.random() < 0.6:
        left = rng.choice([-1, 0, 1, rng.randint(0, s)])
        right = 0 if is_causal else rng.choice([-1, 0, 1, rng.randint(0, s)])
        window = (left, right)
    cu = None
    if rng.random() < 0.5:
        cuts = sorted(rng.randint(0, s) for _ in range(rng.randint(1, 5)))
        cu = [0, *cuts, s]  # repeated boundaries: empty documents; neighbours: one-token ones
    heads = rng.choice(HEADS)
    strategies = ["ring", "auto"]
    if layout in ("contiguous", "zigzag"):
        strategies.append("allgather")
    hq, hkv = heads
    if hq % n == 0 and (hkv % n == 0 or n % hkv == 0):
        strategies.append("ulysses")
    return dict(layout_spec=layout, s=s, is_causal=is_causal, window=window, cu=cu, heads=heads,
                d=8, dv=rng.choice([8, 4]), b=rng.choice([1, 2]), softcap=rng.choice([None, None, 3.0]),
                with_sinks=rng.random() < 0.3, strategy=rng.choice(strategies), seed=rng.randint(0, 999))


def run_case(case):
    case = dict(case)
    return errors(case.pop("layout_spec"), case.pop("s"), **case)


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_random_combinations_are_exact(world_size):
    rng = random.Random(1000 + world_size)
    for i in range(14):
        case = draw_case(rng, world_size)
        for rank, r in enumerate(run_ranks(world_size, run_case, case)):
            for key in KEYS:
                if key in r:
                    assert r[key] < 1e-10, (i, case, rank, key, r[key])


def compiled_vs_eager(case) -> dict:
    """The case's call under torch.compile(fullgraph=True, aot_eager) and eagerly: the largest
    difference of out and every gradient, and the graph breaks."""
    import math

    import torch
    from torch._dynamo.utils import counters

    c = dict(case)
    layout, s = dtcp.layout_from_spec(c["layout_spec"]), c["s"]
    (hq, hkv), d, dv, b = c["heads"], c["d"], c["dv"], c["b"]
    g = torch.Generator().manual_seed(c["seed"] + s)
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, s, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) if c["with_sinks"] else None
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32)
    kwargs = dict(layout=layout, is_causal=c["is_causal"], scale=0.7 / math.sqrt(d), enable_gqa=hq != hkv,
                  window_size=c["window"], softcap=c["softcap"], strategy=c["strategy"])

    def attention(q, k, v, sinks, cu):
        return dtcp.ring_attention(q, k, v, sinks=sinks, cu_seqlens=cu, **kwargs)

    torch._dynamo.reset()
    counters.clear()
    results = []
    for fn in (attention, torch.compile(attention, backend="aot_eager", fullgraph=True)):
        leaves = [layout.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
        my_sinks = None if sinks is None else sinks.clone().requires_grad_()
        out = fn(*leaves, my_sinks, cu)
        out.backward(layout.shard(dout, dim=2))
        results.append([out.detach()] + [t.grad for t in leaves] + ([my_sinks.grad] if sinks is not None else []))
    diff = max((x - y).abs().max().item() for x, y in zip(*results))
    return {"diff": diff, "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_random_combinations_compile_to_the_same_numbers(world_size):
    """Four random combinations per world size under torch.compile(fullgraph=True) with
    aot_eager: out and every gradient equal to eager bit for bit, no graph break."""
    rng = random.Random(7000 + world_size)
    for i in range(4):
        case = draw_case(rng, world_size)
        for rank, r in enumerate(run_ranks(world_size, compiled_vs_eager, case, timeout=300)):
            assert r == {"diff": 0.0, "graph_breaks": 0}, (i, case, rank, r)
