"""Sliding-window and document-masked (varlen) ring attention against single-process reference
attention with the same mask, on spawned gloo ranks, in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import assert_each_error_names_its_fix, error_messages_of, reference_attention, rel_err, window_doc_mask

KEYS = ("out", "lse", "dq", "dk", "dv")


def make_inputs(seed, b, hq, hkv, s, d):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def err(a, b):
    """Relative error; where the exact answer is exactly zero (window (0, 0): every query sees
    only itself, so dq and dk vanish) the absolute norm of the computed value, inputs being O(1)."""
    if b.double().norm() == 0:
        return a.double().norm().item() if torch.isfinite(a).all() else float("inf")
    return rel_err(a, b)


def masked_errors(layout_spec, s, is_causal=False, window=None, cu=None, heads=(4, 2), d=8, b=2,
                  backend="auto", seed=0, how="kwarg", strategy="auto"):
    """On every rank: relative errors of out, lse, dq, dk, dv against reference attention with
    the same window and document mask (its fully masked rows: out 0, lse 0, no gradient).
    `how` passes the window as window_size= ("kwarg"), through dtcp.attention_window ("scope")
    or through the layout (layout_spec "window:L:R", window None)."""
    hq, hkv = heads
    layout = dtcp.layout_from_spec(layout_spec)
    q, k, v, dout = make_inputs(seed + s, b, hq, hkv, s, d)
    ref_window = window if window is not None else getattr(layout, "window", (-1, -1))
    mask = window_doc_mask(s, is_causal=is_causal, window=ref_window, cu_seqlens=cu)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, is_causal=is_causal, mask=mask)
    out_ref.backward(dout)
    lse_ref = lse_ref.detach().masked_fill(torch.isneginf(lse_ref), 0.0)

    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    kwargs = dict(layout=layout, is_causal=is_causal, enable_gqa=hq != hkv, backend=backend, return_lse=True,
                  strategy=strategy)
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    if how == "scope":
        with dtcp.attention_window(*window):
            out, lse = dtcp.ring_attention(*local, **kwargs)
    else:
        out, lse = dtcp.ring_attention(*local, window_size=window, **kwargs)
    out.backward(layout.shard(dout, dim=2))
    return sharded_errors(layout, (out, lse, *(t.grad for t in local)), (out_ref, lse_ref, *(t.grad for t in ref)))


def sharded_errors(layout, got, full) -> dict:
    """{"out", "lse", "dq", "dk", "dv"}: this rank's results against its shard of the full ones."""
    return {key: err(g, layout.shard(f, dim=2)) for key, g, f in zip(KEYS, got, full)}


def assert_exact(results, what=""):
    for key in KEYS:
        worst = max(r[key] for r in results)
        assert worst < 1e-10, (what, key, [r[key] for r in results])


# M = 4 tokens per rank on 4 ranks (S = 16): windows smaller than, equal to and larger than M,
# larger than the whole sequence, and windows looking ahead (right > 0).
CAUSAL_WINDOWS = [(0, 0), (2, 0), (4, 0), (6, 0), (40, 0), (3, -1)]
TWO_SIDED = [(1, 2), (5, 6), (0, 9), (-1, 3), (3, -1), (30, 30)]


@pytest.mark.parametrize("window", CAUSAL_WINDOWS, ids=str)
def test_causal_window_contiguous(window):
    assert_exact(run_ranks(4, masked_errors, "contiguous", 16, True, window), window)


@pytest.mark.parametrize("window", TWO_SIDED, ids=str)
def test_two_sided_window_contiguous(window):
    assert_exact(run_ranks(4, masked_errors, "contiguous", 16, False, window), window)


@pytest.mark.parametrize("layout", ["zigzag", "striped:1", "striped:2"])
@pytest.mark.parametrize("window,is_causal", [((3, 0), True), ((2, 5), False)], ids=str)
def test_window_other_layouts(layout, window, is_causal):
    assert_exact(run_ranks(4, masked_errors, layout, 16, is_causal, window), (layout, window))


def test_window_layout_and_scope_and_mha():
    """SlidingWindow carries its window; attention_window sets one for the calls inside; MHA."""
    assert_exact(run_ranks(2, masked_errors, "window:3:0", 8, False, None), "layout")
    assert_exact(run_ranks(2, masked_errors, "contiguous", 8, True, (5, 0), heads=(2, 2), how="scope"), "scope")


DOCS_16 = {
    "short_docs": [0, 2, 5, 7, 16],
    "spanning": [0, 11, 16],
    "aligned": [0, 4, 8, 12, 16],
    "no_start_on_ranks_1_2": [0, 3, 13, 16],
    "single_tokens": [0, 1, 2, 3, 9, 10, 16],
}


@pytest.mark.parametrize("cu", DOCS_16.values(), ids=DOCS_16.keys())
@pytest.mark.parametrize("window,is_causal", [((-1, -1), True), ((-1, -1), False), ((5, 0), True), ((1, 2), False)], ids=str)
def test_documents_contiguous(cu, window, is_causal):
    assert_exact(run_ranks(4, masked_errors, "contiguous", 16, is_causal, window, cu), (cu, window))


@pytest.mark.parametrize("layout", ["zigzag", "striped:1"])
def test_documents_other_layouts(layout):
    assert_exact(run_ranks(4, masked_errors, layout, 16, True, (6, 0), [0, 3, 13, 16]), layout)
    assert_exact(run_ranks(4, masked_errors, layout, 16, False, None, [0, 1, 7, 16]), layout)


def test_world_2_and_8():
    assert_exact(run_ranks(2, masked_errors, "contiguous", 12, True, (7, 0), [0, 5, 6, 12], heads=(3, 1), d=5))
    assert_exact(run_ranks(8, masked_errors, "contiguous", 32, True, (9, 0), [0, 3, 17, 18, 32], heads=(4, 2)))
    assert_exact(run_ranks(8, masked_errors, "contiguous", 32, False, (3, 6)))


# ---- communication bound ------------------------------------------------------------------

def counted_rounds(s, window, is_causal, heads=(4, 2), d=8, b=2):
    dtcp.comm_stats.reset()
    hq, hkv = heads
    q, k, v, dout = make_inputs(0, b, hq, hkv, s, d)
    layout = dtcp.Contiguous()
    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = dtcp.ring_attention(*local, layout=layout, is_causal=is_causal, window_size=window, enable_gqa=True, backend="math")
    fwd = (dtcp.comm_stats.kv_rounds, dtcp.comm_stats.kv_bytes_sent)
    out.backward(layout.shard(dout, dim=2))
    st = dtcp.comm_stats
    block = 2 * local[1].numel() * local[1].element_size()  # K + V of one rank, float64
    return {"fwd": fwd, "bwd_kv": (st.kv_rounds - fwd[0], st.kv_bytes_sent - fwd[1]),
            "bwd_grad": (st.grad_rounds, st.grad_bytes_sent), "block": block}


@pytest.mark.parametrize("world_size,window,is_causal", [
    (4, (3, 0), True), (4, (4, 0), True), (4, (5, 0), True), (4, (8, 0), True), (4, (100, 0), True),
    (8, (0, 0), True), (8, (9, 0), True), (4, (2, 5), False), (8, (4, 4), False), (4, (1, 2), False),
])
def test_rounds_and_bytes_are_bounded_by_the_window(world_size, window, is_causal):
    """Contiguous layout, M = 4 tokens per rank: the forward makes exactly C = ceil(left / M) +
    ceil(right / M) (at most N - 1) rounds, and sends of each block only the keys the window lets
    its holders see: a left window of W < M needs the last W keys of the block before (all M
    when W >= M), a right window the first min(M, right) keys of the block after; a block at the
    sequence's edge is needed by nobody and sends nothing. The backward sends the same K/V again
    and the matching dK/dV (float64 here, so the same bytes per key)."""
    m, n = 4, world_size
    left, right = window
    results = run_ranks(n, counted_rounds, m * n, window, is_causal)
    c = min(math.ceil(left / m) + math.ceil(right / m), n - 1)
    c_left = min(math.ceil(left / m), n - 1)
    c_right = c - c_left

    def left_keys(block):  # keys of `block` that the next ranks' queries see
        return min(m, left) if c_left and block < n - 1 else 0

    def right_keys(block):  # keys of `block` that the previous ranks' queries see
        return min(m, right) if c_right and block > 0 else 0

    for s, r in enumerate(results):
        per_key = r["block"] // m  # K + V bytes of one key
        # hop h of the left chain sends block s - h + 1 forward; of the right chain, block s + h - 1
        kv = sum(left_keys((s - h + 1) % n) for h in range(1, c_left + 1))
        kv += sum(right_keys((s + h - 1) % n) for h in range(1, c_right + 1))
        # hop h passes on (or sends home) the dK/dV of the block held there: s - h, or s + h
        grad = sum(left_keys((s - h) % n) for h in range(1, c_left + 1))
        grad += sum(right_keys((s + h) % n) for h in range(1, c_right + 1))
        assert r["fwd"] == (c, kv * per_key), (s, r)
        assert r["bwd_kv"] == (c, kv * per_key), (s, r)
        assert r["bwd_grad"] == (c, grad * per_key), (s, r)
    if 0 < left < m and right == 0:  # the point of spans: a rank inside the sequence sends W of its M keys
        assert results[1]["fwd"][1] == c_left * left * results[1]["block"] // m


# ---- bad input ----------------------------------------------------------------------------

def window_error_messages():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    cu = lambda *c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    cases = {
        "window_int": lambda: dtcp.ring_attention(q, q, q, window_size=4),
        "window_float": lambda: dtcp.ring_attention(q, q, q, window_size=(4.0, 0)),
        "window_neg": lambda: dtcp.ring_attention(q, q, q, window_size=(-3, 0)),
        "causal_right": lambda: dtcp.ring_attention(q, q, q, is_causal=True, window_size=(4, 2)),
        "cu_list": lambda: dtcp.ring_attention(q, q, q, cu_seqlens=[0, 8]),
        "cu_float": lambda: dtcp.ring_attention(q, q, q, cu_seqlens=torch.tensor([0.0, 8.0])),
        "cu_start": lambda: dtcp.ring_attention(q, q, q, cu_seqlens=cu(1, 8)),
        "cu_end_local": lambda: dtcp.ring_attention(q, q, q, cu_seqlens=cu(0, 4)),
        "cu_decreasing": lambda: dtcp.ring_attention(q, q, q, cu_seqlens=cu(0, 5, 3, 8)),
        "sliding_window_bad": lambda: dtcp.SlidingWindow(-2),
        "scope_bad": lambda: dtcp.attention_window("4096").__enter__(),
    }
    return error_messages_of(cases)


WINDOW_EXPECTED = {
    "window_int": "window_size must be a pair of ints",
    "window_float": "window_size must be a pair of ints",
    "window_neg": "or -1 for unbounded",
    "causal_right": "use window_size=(4, 0)",
    "cu_list": "cu_seqlens must be a 1-D int32 tensor",
    "cu_float": "1-D int32 (or int64) tensor",
    "cu_start": "starts at 1, not 0",
    "cu_end_local": "ends at 4 but the sequence has S = 8",
    "cu_decreasing": "decreases at index 2",
    "sliding_window_bad": "SlidingWindow(left, right) entries must be >= 0",
    "scope_bad": "attention_window(left, right) must be a pair of ints",
}


def test_bad_window_and_cu_seqlens_raise_clear_errors():
    messages = run_ranks(2, window_error_messages)[0]
    assert_each_error_names_its_fix(messages, WINDOW_EXPECTED)


# ---- torch.compile --------------------------------------------------------------------------

def compiled_window_varlen(how):
    """A windowed, document-masked attention compiled with aot_eager and fullgraph: no graph
    breaks, one frame over steps with different documents, results equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layout = dtcp.Contiguous()

    def attn(q, k, v, cu):
        if how == "scope":
            with dtcp.attention_window(5, 0):
                return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, cu_seqlens=cu)
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, window_size=(5, 0), enable_gqa=True, cu_seqlens=cu)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs = []
    # cu_seqlens of one fixed size (repeated boundaries = empty documents) keep one graph; a
    # new size would recompile once, with a dynamic size.
    for step, docs in enumerate([[0, 3, 13, 16, 16], [0, 16, 16, 16, 16], [0, 1, 2, 9, 16]]):
        cu = torch.tensor(docs, dtype=torch.int32)
        q, k, v, dout = (dtcp.Contiguous().shard(t, dim=2) for t in make_inputs(step, 1, 4, 2, 16, 8))
        le = [t.clone().requires_grad_() for t in (q, k, v)]
        lc = [t.clone().requires_grad_() for t in (q, k, v)]
        ye, yc = attn(*le, cu), compiled(*lc, cu)
        ye.backward(dout)
        yc.backward(dout)
        errs += [rel_err(yc, ye)] + [rel_err(c.grad, e.grad) for c, e in zip(lc, le)]
    return {"max_err": max(errs), "frames": counter.frame_count, "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("how", ["kwarg", "scope"])
def test_compile_window_varlen_no_graph_breaks(how):
    for r in run_ranks(4, compiled_window_varlen, how, timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


# ---- per-document zigzag with padding: fully masked rows --------------------------------------

def doc_zigzag_errors(doc_lens, window, heads=(4, 2), d=8):
    """Packed documents, padded per document and dealt in zigzag; padding rows see nothing."""
    n = dist.get_world_size()
    layout = dtcp.DocZigzag(tuple(doc_lens))
    total = sum(doc_lens)
    q, k, v, dout = (t.transpose(1, 2)[0] for t in make_inputs(3, 1, heads[0], heads[1], total, d))  # (T, H, D)
    # reference: the padded full sequence with the padding masked out entirely
    qp, kp, vp, doutp = (layout.pad(t, n, dim=0).transpose(0, 1)[None] for t in (q, k, v, dout))
    s = qp.shape[2]
    mask = window_doc_mask(s, is_causal=True, window=window, segments=layout.segments(n))
    ref = [t.clone().requires_grad_() for t in (qp, kp, vp)]
    out_ref, lse_ref = reference_attention(*ref, mask=mask)
    out_ref.backward(doutp)
    lse_ref = lse_ref.detach().masked_fill(torch.isneginf(lse_ref), 0.0)

    local = [layout.shard_packed(t, dim=0).detach().requires_grad_() for t in (q, k, v)]  # (S_local, H, D)
    out, lse = dtcp.flash_attn_varlen_func(*local, None, causal=True, window_size=window, layout=layout, return_lse=True)
    keep = layout.loss_mask()
    (out * layout.shard_packed(dout, dim=0) * keep[:, None, None]).sum().backward()
    shard = lambda t: layout.shard(t, dim=2)[0].transpose(0, 1)  # noqa: E731
    pad = ~keep
    finite = all(torch.isfinite(t).all() for t in (out, lse, *(x.grad for x in local)))
    # the loss-masked padding rows: out exactly 0, lse exactly 0, no gradient in or out
    holds_padding = bool(pad.any())
    padding_zero = all(
        bool((t[pad] == 0).all()) for t in (out, lse.transpose(0, 1), local[0].grad, local[1].grad, local[2].grad)
    )
    packed = layout.unshard_packed(out, dim=0)
    ref_masked_dout = [r.grad for r in ref]
    return {
        "out": err(out, shard(out_ref)),
        "lse": err(lse, layout.shard(lse_ref, dim=2)[0]),
        "dq": err(local[0].grad, shard(ref_masked_dout[0])),
        "dk": err(local[1].grad, shard(ref_masked_dout[1])),
        "dv": err(local[2].grad, shard(ref_masked_dout[2])),
        "finite": finite, "padding_zero": padding_zero, "holds_padding": holds_padding,
        "packed": err(packed, out_ref[0].transpose(0, 1)[layout.real_positions(n)]),
        "real_tokens": int(keep.sum()),
    }


@pytest.mark.parametrize("world_size,doc_lens,window", [
    (2, [5, 3, 9], (-1, -1)), (4, [1, 13, 2, 7], (4, 0)), (4, [17], (-1, -1)), (8, [3, 30, 1], (6, 0)),
])
def test_doc_zigzag_with_padding(world_size, doc_lens, window):
    results = run_ranks(world_size, doc_zigzag_errors, doc_lens, window)
    assert_exact(results, (doc_lens, window))
    assert sum(r["real_tokens"] for r in results) == sum(doc_lens)
    for r in results:
        assert r["finite"] and r["packed"] < 1e-10, r
    assert any(r["holds_padding"] for r in results)  # the case has padding somewhere
    for r in results:  # and on every rank that holds some, all of it is zero
        assert r["padding_zero"] or not r["holds_padding"], r


def varlen_matches_ring_attention(cu):
    """flash_attn_varlen_func on (T, H, D) equals ring_attention on (1, H, T, D)."""
    q, k, v, dout = make_inputs(5, 1, 4, 2, cu[-1], 8)
    layout = dtcp.Contiguous()
    q, k, v = (layout.shard(t, dim=2) for t in (q, k, v))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    a = dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, window_size=(3, 0), enable_gqa=True, cu_seqlens=cu_t)
    b, lse = dtcp.flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in (q, k, v)), cu_t, max(np_diff(cu)),
                                         causal=True, window_size=(3, 0), return_lse=True)
    return torch.equal(b, a[0].transpose(0, 1)) and lse.shape == (4, q.shape[2])


def np_diff(cu):
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def test_flash_attn_varlen_func():
    assert all(run_ranks(2, varlen_matches_ring_attention, [0, 3, 4, 16]))


# ---- property test ------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def masked_cases(draw):
    world_size = draw(st.sampled_from([2, 4]))
    layout = draw(st.sampled_from(["contiguous", "contiguous", "zigzag", "striped:1"]))
    local_len = draw(st.integers(1, 5)) * (2 if layout == "zigzag" else 1)
    s = world_size * local_len
    cuts = sorted(draw(st.sets(st.integers(1, s - 1), max_size=5))) if s > 1 else []
    cu = [0, *cuts, s] if draw(st.booleans()) else None
    is_causal = draw(st.booleans())
    left = draw(st.integers(-1, s + 2))
    right = draw(st.sampled_from([-1, 0])) if is_causal else draw(st.integers(-1, s // 2 + 1))
    return world_size, layout, s, is_causal, (left, right), cu


@settings(max_examples=25, deadline=None)
@given(masked_cases())
def test_property_random_documents_and_windows(case):
    world_size, layout, s, is_causal, window, cu = case
    assert_exact(run_ranks(world_size, masked_errors, layout, s, is_causal, window, cu, heads=(2, 1), d=4, b=1), case)
