"""Softcap (Gemma 2), attention sinks (gpt-oss) and a value head dim of its own (MLA) through the
ring and the all-gather schedule, in float64 against dense single-process attention (out, lse, dq,
dk, dv and the sinks' gradient), with windows, documents, GQA and every layout; compiled equal to
eager; and the errors for kernels that lack a feature."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import assert_each_error_names_its_fix, exact_err, rel_err, window_doc_mask

KEYS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def dense_reference(q, k, v, *, mask, scale, softcap=None, sinks=None):
    """float64, differentiable: scores * scale, capped (softcap * tanh(s / softcap)), masked; the
    sink, when given, one more column per row (logit sinks[h], unscaled, unmasked, no value), as
    gpt-oss's eager attention. Rows that see nothing give out 0, lse -inf (no sink) or the sink."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def errors(layout_spec, s, *, is_causal=True, window=None, cu=None, heads=(4, 2), d=8, dv=None, b=2,
           softcap=None, with_sinks=False, strategy="ring", backend="auto", seed=0, group=None):
    # (cu: the documents of the reference's mask, and passed as cu_seqlens unless the layout
    # carries them itself, as Balanced does)
    hq, hkv = heads
    dv = dv or d
    layout = dtcp.layout_from_spec(layout_spec)
    g = torch.Generator().manual_seed(seed + s)
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, s, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) if with_sinks else None
    scale = 0.7 / math.sqrt(d)
    mask = window_doc_mask(s, is_causal=is_causal, window=window or (-1, -1), cu_seqlens=cu)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out_ref, lse_ref = dense_reference(*ref, mask=mask, scale=scale, softcap=softcap, sinks=ref_sinks)
    out_ref.backward(dout)

    local = [layout.shard(t, group, dim=2).clone().requires_grad_() for t in (q, k, v)]
    my_sinks = None if sinks is None else sinks.clone().requires_grad_()
    kwargs = dict(layout=layout, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv, return_lse=True,
                  window_size=window, softcap=softcap, sinks=my_sinks, strategy=strategy, backend=backend)
    if group is not None:
        kwargs["group"] = group
    if cu is not None and not isinstance(layout, dtcp.Balanced):
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    out, lse = dtcp.ring_attention(*local, **kwargs)
    out.backward(layout.shard(dout, group, dim=2))
    shard = lambda t: layout.shard(t, group, dim=2)  # noqa: E731
    got = {"out": out, "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    want = {"out": shard(out_ref), "lse": shard(lse_ref), "dq": shard(ref[0].grad), "dk": shard(ref[1].grad),
            "dv": shard(ref[2].grad)}
    result = {key: exact_err(got[key], want[key]) for key in got}
    if sinks is not None:
        dsinks = my_sinks.grad.clone()
        dist.all_reduce(dsinks)  # each rank holds its rows' share, as for any parameter
        result["dsinks"] = rel_err(dsinks, ref_sinks.grad)
    result["out_shape"] = tuple(out.shape)
    return result


def assert_exact(results, what):
    for r in results:
        for key in KEYS:
            if key in r:
                assert r[key] < 1e-10, (what, key, r)


def one_launch_errors(*args, **kwargs):
    """`errors` with the ring's steps as one varlen launch each (the math kernel's varlen loop
    stands in for FA4's one launch): with a sink the float32 accumulators cover every row (the
    sink is added once per row after the merge); without, the first launch writes the results.
    Also: how many varlen launches ran."""
    from dtcp.kernels.math import MathKernel
    dtcp.exec.route.clear_routes()
    launches = [0]
    varlen_fwd = MathKernel.varlen_forward

    def counted(self, *a, **k):
        launches[0] += 1
        return varlen_fwd(self, *a, **k)

    MathKernel.varlen_one_launch, MathKernel.varlen_forward = True, counted
    try:
        return {**errors(*args, backend="math", **kwargs), "launches": launches[0]}
    finally:
        MathKernel.varlen_one_launch, MathKernel.varlen_forward = False, varlen_fwd
        dtcp.exec.route.clear_routes()


@pytest.mark.parametrize("features", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("layout", ["zigzag", "balanced@1:9,3,14,6"])
def test_softcap_and_sinks_with_one_launch_steps(features, layout):
    """The fused ring (one varlen launch a step, as FA4 runs it; packed documents, where a step
    has several tasks) with softcap and sinks, 4 ranks, float64: exact, and the launches ran."""
    opts = dict(softcap=2.5 if features != "sinks" else None, with_sinks=features != "softcap")
    results = run_ranks(4, one_launch_errors, layout, 32, cu=[0, 9, 12, 26, 32], **opts)
    assert_exact(results, (layout, features))
    assert any(r["launches"] > 0 for r in results), results  # (a rank whose steps are one task each runs them so)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("features", ["softcap", "sinks", "both"])
def test_softcap_and_sinks_exact(strategy, layout, features):
    softcap = 2.5 if features in ("softcap", "both") else None
    sinks = features in ("sinks", "both")
    backend = "math" if strategy == "allgather" else "auto"  # cpu_flash has neither: auto picks math
    assert_exact(run_ranks(2, errors, layout, 16, softcap=softcap, with_sinks=sinks, strategy=strategy,
                           backend=backend), (layout, features, strategy))


@pytest.mark.parametrize("case", ["window", "documents", "full", "striped", "mqa"])
def test_softcap_and_sinks_with_masks_four_ranks(case):
    opts = dict(softcap=3.0, with_sinks=True)
    if case == "window":
        results = run_ranks(4, errors, "contiguous", 16, window=(5, 0), **opts)
    elif case == "documents":
        results = run_ranks(4, errors, "contiguous", 16, cu=[0, 3, 13, 16], window=(6, 0), **opts)
    elif case == "full":
        results = run_ranks(4, errors, "zigzag", 16, is_causal=False, **opts)
    elif case == "striped":
        results = run_ranks(4, errors, "striped:1", 16, **opts)
    else:
        results = run_ranks(4, errors, "zigzag", 16, heads=(3, 1), d=5, **opts)
    assert_exact(results, case)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_value_head_dim_of_its_own(strategy, layout):
    """MLA-style: q/k head dim 12, v head dim 8 (SDPA allows it)."""
    results = run_ranks(2, errors, layout, 16, d=12, dv=8, strategy=strategy, backend="math")
    assert_exact(results, (layout, strategy))
    assert all(r["out_shape"] == (2, 4, 8, 8) for r in results)


def test_value_head_dim_with_sinks_softcap_and_documents():
    results = run_ranks(2, errors, "contiguous", 16, d=12, dv=4, softcap=2.0, with_sinks=True, cu=[0, 5, 16])
    assert_exact(results, "mla + sinks + softcap + documents")


def compiled_sinks_softcap():
    """Compiled (aot_eager, fullgraph) with softcap and sinks (a parameter): equal to eager,
    no graph break, one frame over steps."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sinks_e = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    sinks_c = torch.nn.Parameter(sinks_e.detach().clone())

    def attn(q, k, v, sinks):
        return dtcp.ring_attention(q, k, v, layout="zigzag", is_causal=True, enable_gqa=True, softcap=2.0, sinks=sinks)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs = []
    for step in range(3):
        g = torch.Generator().manual_seed(step + dist.get_rank())
        q, k, v = (torch.randn(2, h, 8, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        le = [t.clone().requires_grad_() for t in (q, k, v)]
        lc = [t.clone().requires_grad_() for t in (q, k, v)]
        ye, yc = attn(*le, sinks_e), compiled(*lc, sinks_c)
        ye.square().sum().backward()
        yc.square().sum().backward()
        errs += [rel_err(yc, ye), rel_err(sinks_c.grad, sinks_e.grad)] + [rel_err(c.grad, e.grad) for c, e in zip(lc, le)]
    return {"max_err": max(errs), "frames": counter.frame_count, "graph_breaks": sum(counters["graph_break"].values())}


def test_softcap_and_sinks_compiled():
    for r in run_ranks(2, compiled_sinks_softcap, timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


def fast_path_equals_op():
    """The eager fast path and the custom op agree bit for bit with softcap and sinks."""
    results = []
    for fast in (True, False):
        with dtcp.config.override(eager_fast_path=fast):
            torch.manual_seed(dist.get_rank())
            q, k, v = (torch.randn(1, h, 8, 6, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
            sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
            out = dtcp.ring_attention(q, k, v, is_causal=True, enable_gqa=True, softcap=1.5, sinks=sinks)
            out.backward(torch.cos(out.detach()))
            results.append([out.detach(), q.grad, k.grad, v.grad, sinks.grad])
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_fast_path_equals_op_with_softcap_and_sinks():
    assert all(run_ranks(2, fast_path_equals_op))


def feature_errors():
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    out = {}
    cases = {
        "softcap_negative": lambda: dtcp.ring_attention(q, k, k, enable_gqa=True, softcap=-1.0),
        "sinks_shape": lambda: dtcp.ring_attention(q, k, k, enable_gqa=True, sinks=torch.zeros(2)),
        "sinks_int": lambda: dtcp.ring_attention(q, k, k, enable_gqa=True, sinks=torch.zeros(4, dtype=torch.long)),
        "cpu_flash_softcap": lambda: dtcp.ring_attention(q, k, k, enable_gqa=True, softcap=2.0, backend="cpu_flash"),
        "cpu_flash_value_dim": lambda: dtcp.ring_attention(q, k, torch.randn(1, 2, 8, 4, dtype=torch.float64),
                                                          enable_gqa=True, backend="cpu_flash"),
        "allgather_sinks_cpu_flash": lambda: dtcp.ring_attention(q, k, k, enable_gqa=True, sinks=torch.zeros(4),
                                                                 strategy="allgather", backend="cpu_flash"),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = str(e)
    return out


FEATURE_EXPECTED = {
    "softcap_negative": "softcap must be a positive number",
    "sinks_shape": "one logit per query head",
    "sinks_int": "sinks must be a 1-D floating-point tensor",
    "cpu_flash_softcap": "cpu_flash has no softcap",
    "cpu_flash_value_dim": "cpu_flash needs v's head dim to equal",
    "allgather_sinks_cpu_flash": "cpu_flash takes no attention sinks",
}


def test_feature_errors_name_the_fix():
    messages = run_ranks(2, feature_errors)[0]
    assert_each_error_names_its_fix(messages, FEATURE_EXPECTED)
