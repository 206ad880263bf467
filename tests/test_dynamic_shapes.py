"""Compiled models whose sequence length and batch size change every step, as training loops do
(packing to variable lengths, evaluation at another length, length curricula): equal to eager, no
graph break, and at most one recompile after the first compile, then none. With automatic dynamic
shapes, `dynamic=True` and `torch._dynamo.mark_dynamic`; the ring, the all-gather schedule (traced
while shapes are static), windows and documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import rel_err

DIM = 16


class Block(torch.nn.Module):
    """Projections around one dtcp.ring_attention call, as a model layer has them."""

    def __init__(self, layout="zigzag", strategy="auto", window=None, hq=4, hkv=2):
        super().__init__()
        self.hq, self.hkv, self.hd = hq, hkv, DIM // hq
        self.q = torch.nn.Linear(DIM, hq * self.hd, bias=False)
        self.kv = torch.nn.Linear(DIM, 2 * hkv * self.hd, bias=False)
        self.o = torch.nn.Linear(hq * self.hd, DIM, bias=False)
        self.layout, self.strategy, self.window = dtcp.layout_from_spec(layout), strategy, window

    def forward(self, x, cu_seqlens=None):  # x: (B, S_local, DIM)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.hd).permute(2, 0, 3, 1, 4)
        y = dtcp.ring_attention(q, k, v, layout=self.layout, is_causal=True, enable_gqa=True,
                                strategy=self.strategy, window_size=self.window, cu_seqlens=cu_seqlens)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


# (batch, local length) per step: the second step changes both, so automatic dynamic shapes mark
# both dynamic at once; sizes 1 are avoided (dynamo specializes dims of size 1).
STEPS = [(2, 8), (3, 12), (2, 16), (4, 4), (3, 20), (2, 8)]


def changing_shapes(compile_backend, mode, layout="zigzag", strategy="auto", window=None, documents=False,
                    dtype_name="float64"):
    """Per step: eager vs compiled output and parameter gradients; frames compiled after each step."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    dtype = getattr(torch, dtype_name)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Block(layout, strategy, window).to(dtype)
    model = Block(layout, strategy, window).to(dtype)
    model.load_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True if mode == "dynamic" else None)
    n = dist.get_world_size()
    errs, frames = [], []
    for step, (b, s_local) in enumerate(STEPS):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x = torch.randn(b, s_local, DIM, generator=g, dtype=dtype)
        cu = None
        if documents:  # a new document structure every step, as many boundaries as the step has
            s = s_local * n
            cuts = sorted({(s * (i + 1)) // (step + 3) for i in range(step + 2)} - {0, s})
            cu = torch.tensor([0, *cuts, s], dtype=torch.int32)
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
        ye, yc = eager(x, cu), compiled(x, cu)
        ye.square().sum().backward()
        yc.square().sum().backward()
        errs.append(rel_err(yc, ye))
        for pe, pc in zip(eager.parameters(), model.parameters()):
            errs.append(rel_err(pc.grad, pe.grad))
            pe.grad = pc.grad = None
        frames.append(counter.frame_count)
    return {"max_err": max(errs), "frames": frames, "graph_breaks": sum(counters["graph_break"].values())}


def check(results, tol):
    for r in results:
        assert r["graph_breaks"] == 0, r
        assert r["max_err"] < tol, r
        # the first compile, at most one recompile (at the second step), then none
        assert r["frames"][-1] <= 2 and r["frames"][-1] == r["frames"][1], r


@pytest.mark.parametrize("mode", ["automatic", "dynamic", "mark_dynamic"])
@pytest.mark.parametrize("layout,strategy", [("zigzag", "ring"), ("zigzag", "allgather"), ("contiguous", "ring")])
def test_changing_shapes_aot_eager(mode, layout, strategy):
    check(run_ranks(2, changing_shapes, "aot_eager", mode, layout, strategy, timeout=300), 1e-12)


def test_changing_shapes_with_window_and_documents_aot_eager():
    check(run_ranks(2, changing_shapes, "aot_eager", "automatic", "contiguous", "ring", (5, 0), True, timeout=300),
          1e-12)
    check(run_ranks(2, changing_shapes, "aot_eager", "dynamic", "zigzag", "allgather", None, True, timeout=300), 1e-12)


def test_changing_shapes_inductor():
    check(run_ranks(2, changing_shapes, "inductor", "automatic", "zigzag", "ring", dtype_name="float32", timeout=600),
          1e-5)


def test_changing_shapes_four_ranks():
    check(run_ranks(4, changing_shapes, "aot_eager", "automatic", "zigzag", "ring", timeout=300), 1e-12)


# ---- DocZigzag: a new document structure every batch ----------------------------------------------

def doc_zigzag_compiled(compile_backend):
    """flash_attn_varlen_func over DocZigzag shards, compiled once, with a new document structure
    (and padded length) every batch: equal to eager, no graph break, at most one recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def attn(q, k, v, layout):
        return dtcp.flash_attn_varlen_func(q, k, v, None, causal=True, layout=layout)

    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(attn, backend=counter, fullgraph=True)
    errs, frames = [], []
    # the second batch changes both the number of documents and the padded length (so both become
    # dynamic at once), as batches do in training
    for step, docs in enumerate([(5, 3, 9), (2, 15), (4, 4, 9), (6, 6, 5, 1), (17,), (3, 3, 3, 3, 3)]):
        layout = dtcp.DocZigzag(docs)
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(sum(docs), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        local = [layout.shard_packed(t, dim=0) for t in (q, k, v)]
        le = [t.clone().requires_grad_() for t in local]
        lc = [t.clone().requires_grad_() for t in local]
        oe, oc = attn(*le, layout), compiled(*lc, layout)
        oe.sum().backward()
        oc.sum().backward()
        errs += [rel_err(oc, oe)] + [rel_err(c.grad, e.grad) for c, e in zip(lc, le)]
        frames.append(counter.frame_count)
    return {"max_err": max(errs), "frames": frames, "graph_breaks": sum(counters["graph_break"].values())}


def test_doc_zigzag_new_documents_every_batch_compiled():
    check(run_ranks(2, doc_zigzag_compiled, "aot_eager", timeout=300), 1e-12)


# ---- Balanced: a new document mix every batch, placed anew -----------------------------------------

# Packed batches of one length (as packing to a fixed context gives) and then of another; each
# step a new long-tailed mix with another number of documents, so every step cuts and places
# differently (which documents are cut, which are whole, on which rank).
BALANCED_STEPS = [(40, (25, 3, 4, 8)), (40, (2, 30, 1, 1, 6)), (40, (12, 12, 9, 7)), (40, (37, 3)),
                  (48, (5, 33, 4, 1, 1, 4)), (48, (20, 20, 8)), (40, (1, 1, 1, 29, 8))]


def balanced_compiled(compile_backend):
    """A layer calling ring_attention(layout=dtcp.Balanced(docs)), compiled once, a new Balanced
    placement every step: equal to eager (out and every gradient), no graph break, and no
    recompile after the first change of the number of documents."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    n = dist.get_world_size()

    def layer(x, wq, wkv, layout):  # x: (1, S/N, DIM) this rank's tokens, in the layout's order
        b, s, _ = x.shape
        q = (x @ wq).view(b, s, 4, 4).transpose(1, 2)
        k, v = (x @ wkv).view(b, s, 2, 2, 4).permute(2, 0, 3, 1, 4)
        return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, strategy="ring")

    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    wq, wkv = torch.randn(DIM, DIM, generator=g, dtype=torch.float64), torch.randn(DIM, 16, generator=g,
                                                                                   dtype=torch.float64)
    errs, frames, cut = [], [], set()
    for step, (s, docs) in enumerate(BALANCED_STEPS):
        layout = dtcp.Balanced(docs, min_chunk=1)  # (tiny documents get cut too)
        cut.add(dtcp.layouts.balanced.balanced_placement(docs, n, min_chunk=1))
        # (with its own strides, as a model's activations have: a rank whose shard is one slice would
        # get a view with the whole batch's stride on its size-1 dim, which dynamo guards on)
        x = layout.shard(torch.randn(1, s, DIM, generator=g, dtype=torch.float64), dim=1).clone(
            memory_format=torch.contiguous_format)
        pe = [t.clone().requires_grad_() for t in (x, wq, wkv)]
        pc = [t.clone().requires_grad_() for t in (x, wq, wkv)]
        ye, yc = layer(*pe, layout), compiled(*pc, layout)
        ye.square().sum().backward()
        yc.square().sum().backward()
        errs += [rel_err(yc, ye)] + [rel_err(c.grad, e.grad) for c, e in zip(pc, pe)]
        frames.append(counter.frame_count)
    return {"max_err": max(errs), "frames": frames, "graph_breaks": sum(counters["graph_break"].values()),
            "placements": len(cut)}


def test_balanced_new_documents_every_batch_compiled():
    results = run_ranks(2, balanced_compiled, "aot_eager", timeout=300)
    first_new_length = next(i for i, (s, _) in enumerate(BALANCED_STEPS) if s != BALANCED_STEPS[0][0])
    for r in results:
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["placements"] == len(BALANCED_STEPS), r  # every step placed anew
        # a new document mix (and number of documents) is no recompile; a new packed length is
        # dynamo's one automatic-dynamic recompile, then none
        assert r["frames"][:first_new_length] == [1] * first_new_length, r
        assert r["frames"][first_new_length:] == [2] * (len(BALANCED_STEPS) - first_new_length), r
