"""Chunked attention (``ring_attention(chunk_size=C)``, Llama 4's ``attention_chunk_size``): tokens
attend only within consecutive chunks of C tokens of their document, intersected with causality,
the window and the documents. Every layout and strategy on spawned gloo ranks against
single-process reference attention with the dense chunk mask, in float64 (out, lse, dq, dk, dv);
compiled with fullgraph=True (aot_eager)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import reference_attention, window_doc_mask
from test_window_varlen import KEYS, err, make_inputs

S = 32   # 8 tokens per rank on 4 ranks


def chunk_mask(s: int, chunk: int, segments=None) -> torch.Tensor:
    """(S, S) bool: i and j in the same chunk of the same segment, chunks counted from each
    segment's start (the whole row when `segments` is None). Built densely, independently of
    dtcp's planner."""
    seg_start = torch.full((s,), -1, dtype=torch.long)
    for a, b in segments if segments is not None else [(0, s)]:
        seg_start[a:b] = a
    pos = torch.arange(s)
    chunk_id = torch.where(seg_start >= 0, seg_start * s + (pos - seg_start) // chunk, -1 - pos)
    return chunk_id[:, None] == chunk_id[None, :]


def cu_segments(cu):
    return None if cu is None else [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def chunked_errors(cases):
    """On every rank, per case (layout, strategy, chunk, is_causal, window, cu, batch): errors of
    out, lse, dq, dk, dv against the reference."""
    n = dist.get_world_size()
    results = []
    for layout_spec, strategy, chunk, is_causal, window, cu, b in cases:
        hq, hkv = (4, 2) if strategy != "ulysses" else (n, n // 2 if n > 2 else n)
        q, k, v, dout = make_inputs(chunk + S, b, hq, hkv, S, 8)
        layout = dtcp.layout_from_spec(layout_spec)
        if layout_spec.startswith("doczigzag"):
            segments = list(layout.segments(n))
            s = layout.pad(torch.zeros(sum(layout.doc_lens)), n).shape[0]
            q, k, v, dout = make_inputs(chunk + s, b, hq, hkv, s, 8)
            row_masks = [window_doc_mask(s, is_causal=is_causal, window=window or (-1, -1), segments=segments)
                         & chunk_mask(s, chunk, segments)] * b
            cu_arg = None
        else:
            if cu is not None and cu[-1] == b * S:   # each batch row with its own documents
                rows = [[c - r * S for c in cu if r * S <= c <= (r + 1) * S] for r in range(b)]
            else:
                rows = [cu] * b
            row_masks = [window_doc_mask(S, is_causal=is_causal, window=window or (-1, -1), cu_seqlens=rc)
                         & chunk_mask(S, chunk, cu_segments(rc)) for rc in rows]
            cu_arg = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        outs, lses = zip(*(reference_attention(*(t[r:r + 1] for t in ref), mask=m) for r, m in enumerate(row_masks)))
        out_ref, lse_ref = torch.cat(outs), torch.cat(lses)
        out_ref.backward(dout)
        lse_ref = lse_ref.detach().masked_fill(torch.isneginf(lse_ref), 0.0)
        local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
        out, lse = dtcp.ring_attention(*local, layout=layout, is_causal=is_causal, enable_gqa=hq != hkv,
                                       window_size=window, cu_seqlens=cu_arg, strategy=strategy, return_lse=True,
                                       chunk_size=chunk)
        out.backward(layout.shard(dout, dim=2))
        full = (out_ref, lse_ref, *(t.grad for t in ref))
        got = (out, lse, *(t.grad for t in local))
        res = {key: err(g, layout.shard(f, dim=2)) for key, g, f in zip(KEYS, got, full)}
        res["case"] = (layout_spec, strategy, chunk, is_causal, window, cu, b)
        results.append(res)
    return results


def assert_exact(results):
    for r in results:
        for key in KEYS:
            assert r[key] < 1e-10, r


DOCS = [0, 7, 20, 32]           # documents that start off the chunk grid and across shards
ROWS = [0, 13, 32, 35, 64]      # B=2, each row with its own documents


def test_chunked_every_layout_and_strategy():
    cases = []
    for layout in ("contiguous", "zigzag", "striped:1", "striped:2", "grouped:2:zigzag"):
        for chunk in (3, 8, 12):    # smaller than, equal to and larger than a shard of 8
            cases.append((layout, "ring", chunk, True, None, None, 1))
        cases.append((layout, "ring", 5, True, None, DOCS, 1))
        cases.append((layout, "ring", 6, True, (4, 0), DOCS, 1))
    cases += [
        ("contiguous", "ring", 5, False, None, DOCS, 1),            # bidirectional within chunks
        ("contiguous", "ring", 7, False, (2, 3), None, 1),
        ("zigzag", "ring", 5, True, None, ROWS, 2),
        ("doczigzag:9,14,5", "ring", 4, True, None, None, 1),
        ("doczigzag:9,14,5", "ring", 6, True, (3, 0), None, 1),
    ]
    for strategy in ("allgather", "ulysses"):
        for layout in ("contiguous", "zigzag"):
            cases += [(layout, strategy, 5, True, None, None, 1), (layout, strategy, 6, True, (4, 0), DOCS, 1),
                      (layout, strategy, 12, True, None, ROWS, 2)]
    cases.append(("doczigzag:9,14,5", "ulysses", 4, True, None, None, 1))
    results = [r for rank in run_ranks(4, chunked_errors, cases, timeout=300) for r in rank]
    assert len(results) == 4 * len(cases)
    assert_exact(results)


def chunk_of_the_whole_sequence_changes_nothing():
    q, k, v, _ = make_inputs(1, 1, 4, 2, S, 8)
    layout = dtcp.Zigzag()
    local = [layout.shard(t, dim=2) for t in (q, k, v)]
    a = dtcp.ring_attention(*local, layout=layout, is_causal=True, enable_gqa=True, chunk_size=S)
    b = dtcp.ring_attention(*local, layout=layout, is_causal=True, enable_gqa=True)
    return err(a, b)


def test_chunk_as_large_as_the_sequence_is_plain_attention():
    """A chunk of S tokens changes nothing: the result of no chunk_size, to float64 rounding (one
    document [0, S) is planned apart from no documents, so the kernels' sums may differ in order)."""
    assert max(run_ranks(2, chunk_of_the_whole_sequence_changes_nothing)) < 1e-12


def hybrid_errors():
    """strategy="hybrid" on a 2x2 mesh with chunks and documents."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "uly"))
    layout = dtcp.Zigzag()
    q, k, v, dout = make_inputs(7, 1, 4, 2, S, 8)
    mask = window_doc_mask(S, is_causal=True, cu_seqlens=DOCS) & chunk_mask(S, 5, cu_segments(DOCS))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, mask=mask)
    out_ref.backward(dout)
    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = dtcp.ring_attention(*local, mesh, layout=layout, is_causal=True, enable_gqa=True, strategy="hybrid",
                              cu_seqlens=torch.tensor(DOCS, dtype=torch.int32), chunk_size=5)
    out.backward(layout.shard(dout, dim=2))
    return max(err(a, layout.shard(b, dim=2)) for a, b in zip((out, *(t.grad for t in local)),
                                                               (out_ref, *(t.grad for t in ref))))


def test_chunked_hybrid():
    assert max(run_ranks(4, hybrid_errors, timeout=200)) < 1e-10


def compiled_chunked():
    """fullgraph aot_eager: no graph break, one frame over batches with different documents, equal
    to eager (out and gradients)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from reference import rel_err

    torch._dynamo.reset()
    counters.clear()
    layout = dtcp.Zigzag()

    def attn(q, k, v, cu):
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, cu_seqlens=cu,
                                   window_size=(6, 0), chunk_size=5)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs = []
    for step, docs in enumerate([[0, 7, 20, 32, 32], [0, 32, 32, 32, 32], [0, 1, 2, 19, 32]]):
        cu = torch.tensor(docs, dtype=torch.int32)
        q, k, v, dout = (layout.shard(t, dim=2) for t in make_inputs(step, 1, 4, 2, S, 8))
        le = [t.clone().requires_grad_() for t in (q, k, v)]
        lc = [t.clone().requires_grad_() for t in (q, k, v)]
        ye, yc = attn(*le, cu), compiled(*lc, cu)
        ye.backward(dout)
        yc.backward(dout)
        errs += [rel_err(yc, ye)] + [rel_err(c.grad, e.grad) for c, e in zip(lc, le)]
    return {"max_err": max(errs), "frames": counter.frame_count, "graph_breaks": sum(counters["graph_break"].values())}


def test_compiled_chunked_no_graph_breaks():
    for r in run_ranks(2, compiled_chunked, timeout=300):
        assert r["graph_breaks"] == 0 and r["frames"] == 1, r
        assert r["max_err"] < 1e-12, r


def bad_chunk_messages():
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out = {}
    for bad in (0, -3, 2.5, True):
        try:
            dtcp.ring_attention(q, q, q, layout=dtcp.Contiguous(), is_causal=True, chunk_size=bad)
        except ValueError as e:
            out[repr(bad)] = str(e)
        else:
            out[repr(bad)] = None
    return out


def test_bad_chunk_size_raises_on_every_rank():
    for msgs in run_ranks(2, bad_chunk_messages):
        for bad, msg in msgs.items():
            assert msg is not None and "chunk_size must be a positive int" in msg, (bad, msg)


@pytest.mark.parametrize("segments,chunk,want", [
    (None, 4, ((0, 4), (4, 8), (8, 10))),
    (((0, 3), (3, 10)), 4, ((0, 3), (3, 7), (7, 10))),
    (((2, 5), (6, 6)), 2, ((2, 4), (4, 5))),
])
def test_chunk_segments(segments, chunk, want):
    from dtcp.plan import chunk_segments

    assert chunk_segments(segments, 10, chunk) == want
