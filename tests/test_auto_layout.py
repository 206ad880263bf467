"""layout="auto": each batch is sharded with `Balanced` when one packed row holds several
documents, else with `Zigzag` (dtcp/layouts/auto.py), by `dtcp.context_parallel` and the
transformers integration (whose default it is). Exact against one process in float64; compiled
with a new document mix every step: no graph break, no recompile. Also `layout="balanced"` with
`cu_seqlens` (the placement of the boundaries, the form the integrations' attention calls take)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtcp
from dist_harness import run_ranks
from reference import exact_err, reference_attention, window_doc_mask

KEYS = ("out", "dq", "dk", "dv")


def _cu(docs):
    out = [0]
    for n in docs:
        out.append(out[-1] + n)
    return out


# ---- the choice (pure) --------------------------------------------------------------------------------


def test_auto_resolves_documents_to_balanced():
    auto = dtcp.Auto()
    assert auto.resolve([0, 5, 9, 16], 16) == dtcp.Balanced((5, 4, 7))
    assert auto.resolve(torch.tensor([0, 5, 9, 16, 16, 16], dtype=torch.int32), 16) == dtcp.Balanced((5, 4, 7, 0, 0))
    assert dtcp.Auto(min_chunk=1).resolve([0, 5, 16], 16) == dtcp.Balanced((5, 11), min_chunk=1)
    # no documents, one document, or rows with documents of their own (boundaries over B * S): zigzag
    for cu, s in ((None, 16), ([0, 16], 16), ([0, 16, 16], 16), ([0, 5, 16, 20, 32], 16)):
        assert auto.resolve(cu, s) == dtcp.Zigzag(), cu
    assert auto.resolve(None) is auto.resolve([0, 16], 16)  # one object (stable under torch.compile guards)
    assert auto.multiple(4) == 8  # zigzag's: padding to it suits either choice
    assert dtcp.layout_from_spec("auto@64") == dtcp.Auto(min_chunk=64)
    assert dtcp.layout_from_spec("balanced@1:3,5") == dtcp.Balanced((3, 5), min_chunk=1)
    assert dtcp.layout_from_spec("balanced") == dtcp.Balanced()
    with pytest.raises(ValueError, match="chosen per batch"):
        auto.runs(16, 2, 0)
    with pytest.raises(ValueError, match="from_cu_seqlens"):
        dtcp.Balanced().runs(16, 2, 0)
    with pytest.raises(ValueError, match="min_chunk must be an int >= 1"):
        dtcp.Balanced((4, 4), min_chunk=0)


def test_auto_resolves_with_hidden_steps():
    """`resolve(..., hidden_steps=)` gives Balanced those steps; the Balanced without documents that
    the attention calls take for such a batch is one object per hidden-steps value (torch.compile
    guards on it), whatever the batch's documents."""
    auto = dtcp.Auto(min_chunk=4)
    a = auto.resolve([0, 5, 16], 16, hidden_steps=2)
    assert a == dtcp.Balanced((5, 11), min_chunk=4, hidden_steps=2)
    b = auto.resolve([0, 9, 12, 16], 16, hidden_steps=2)
    assert auto.by_boundaries(a) is auto.by_boundaries(b) == dtcp.Balanced(min_chunk=4, hidden_steps=2)
    c = auto.resolve([0, 9, 12, 16], 16)
    assert c.hidden_steps == 0 and auto.by_boundaries(c) == dtcp.Balanced(min_chunk=4)
    assert auto.by_boundaries(c) is not auto.by_boundaries(a)
    assert auto.resolve(None, 16, hidden_steps=2) == dtcp.Zigzag()


def test_hidden_ring_steps_follow_the_cost_objective():
    """What the integrations and context_parallel(layout="auto") give Balanced: none under "call"
    (an isolated call: every step's host time counts), all N under "device", and under "step" the
    steps whose host time (an FA4 launch pair, 0.5 ms, and a ring step's bookkeeping, 0.7 ms, on
    the shipped H200 constants) the rest of the layer's device work covers, at 650 TFLOP/s.
    An 8B-class layer (4096 hidden, 14336 MLP, 32/8 heads of 128) at 8K tokens a rank: 1.31
    GFLOP/token x 8192 / 650e12 = 16.5 ms, 13 steps; a 125M-class one (768, 3072, 12/12 of 64):
    0.71 ms, none."""
    from dtcp.plan import decoder_layer_flops_per_token
    big = decoder_layer_flops_per_token(4096, 14336, 32, 8, 128)
    small = decoder_layer_flops_per_token(768, 3072, 12, 12, 64)
    assert round(big / 1e9, 2) == 1.31 and round(small / 1e6, 1) == 56.6
    with dtcp.config.override(cost_objective="call", layer_flops_per_token=big):
        assert dtcp.hidden_ring_steps(8192, 16) == 0
    with dtcp.config.override(cost_objective="device"):
        assert dtcp.hidden_ring_steps(8192, 16) == 16 and dtcp.hidden_ring_steps(8192, 4) == 4
    with dtcp.config.override(layer_flops_per_token=big):  # ("auto": "step" with the layer's work)
        assert dtcp.hidden_ring_steps(8192, 16) == 13
        assert dtcp.hidden_ring_steps(8192, 8) == 8  # (at most N)
        assert dtcp.hidden_ring_steps(2048, 16) == 3  # (a quarter of the tokens: 4.1 ms)
        assert dtcp.hidden_ring_steps(2048, 16, batch=4) == 13
    with dtcp.config.override(layer_flops_per_token=small):
        assert dtcp.hidden_ring_steps(8192, 16) == 0
    with dtcp.config.override(cost_objective="step"):
        with pytest.raises(ValueError, match="layer_flops_per_token"):
            dtcp.hidden_ring_steps(8192, 16)


def _bench_docs(name, n):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    import bench_split

    case = {c.name: c for c in bench_split.build_cases(1.0)}[name]
    return bench_split.pad_last(case.docs, n)


@pytest.mark.parametrize("name,n,want", [
    # 128K tokens over 16 ranks: the ring's placement keeps one rank at 2.31x / 1.86x the mean's work
    # (log-normal mixes, documents up to 7K / 16K whole) to spare it ring steps
    ("lognormal-s0", 16, "balanced@256+16"),
    ("lognormal-s1", 16, "balanced@256+16"),
    # Pareto s1 (1.59x): Ulysses is the pick on either placement, which it does not change; Pareto
    # s0 and every mix at 8 ranks: the ring's placement is balanced already (within 1.03x)
    ("pareto-s1", 16, "balanced"),
    ("pareto-s0", 16, "balanced"),
    ("lognormal-s0", 8, "balanced"),
    ("lognormal-s1", 8, "balanced"),
    ("pareto-s1", 8, "balanced"),
])
def test_auto_places_for_the_strategy_predicted_fastest(name, n, want):
    """With dtcp.config.auto_placement = "fastest" and attention_heads (32/8 heads of 128, an
    8B-class model's), layout="auto" weighs Balanced's placement for the ring against the one
    balancing the work alone
    (min_chunk 256, every step hidden), each under the strategy the cost model picks on it (the
    shipped H200 constants), and takes the latter where it is predicted 10% faster."""
    from dtcp.api import placed_for_the_fastest_strategy, resolve_auto

    docs = _bench_docs(name, n)
    cu = torch.tensor(_cu(docs), dtype=torch.int32)
    with dtcp.config.override(attention_heads=(32, 8, 128)):  # (the default, auto_placement="ring": as before)
        assert resolve_auto(dtcp.Auto(), cu, sum(docs), n) == dtcp.Balanced(docs)
    with dtcp.config.override(attention_heads=(32, 8, 128), cost_objective="call", auto_placement="fastest"):
        chosen = resolve_auto(dtcp.Auto(), cu, sum(docs), n)
        assert chosen.op_spec() == want, chosen
        ring = dtcp.Balanced(docs)
        work = ring.rank_work(n)
        if want != "balanced":
            # the ring's placement is unbalanced, the chosen one within 1.02x of the mean
            assert max(work) / (sum(work) / n) > 1.8
            assert max(chosen.rank_work(n)) / (sum(work) / n) < 1.02
            # one strategy asked for: the ring on the work-balanced placement pays its steps
            assert placed_for_the_fastest_strategy(ring, n, strategy="ring") == ring
            assert placed_for_the_fastest_strategy(ring, n, strategy="allgather") == chosen
            # hybrid (context_parallel on a 2-D mesh): not predicted here, the ring's placement
            assert placed_for_the_fastest_strategy(ring, n, strategy="hybrid") == ring


def test_auto_placement_choice_leaves_other_batches_as_they_were():
    """Zigzag batches, one rank, and lengths the ranks do not share stay as Auto.resolve gives them."""
    from dtcp.api import resolve_auto

    with dtcp.config.override(attention_heads=(32, 8, 128), auto_placement="fastest"):
        assert resolve_auto(dtcp.Auto(), None, 4096, 16) is dtcp.Auto().resolve(None)
        assert resolve_auto(dtcp.Auto(), [0, 4096], 4096, 16) == dtcp.Zigzag()
        assert resolve_auto(dtcp.Auto(), [0, 100, 4096], 4096, 1) == dtcp.Balanced((100, 3996))
        assert resolve_auto(dtcp.Auto(), [0, 100, 4097], 4097, 16) == dtcp.Balanced((100, 3997))


def test_fastest_placement_without_heads_names_the_setting():
    from dtcp.api import resolve_auto

    with dtcp.config.override(auto_placement="fastest"):
        with pytest.raises(ValueError, match=r"set dtcp.config.attention_heads = \(query heads"):
            resolve_auto(dtcp.Auto(), [0, 100, 4096], 4096, 16)
        assert resolve_auto(dtcp.Auto(), None, 4096, 16) == dtcp.Zigzag()  # (no documents: nothing to place)


def test_attention_heads_checks_its_value():
    for bad in ((32, 5, 128), (32, 8), (0, 8, 128), (32, 8, True), "32,8,128"):
        with pytest.raises(ValueError, match="attention_heads must be"):
            dtcp.config.attention_heads = bad
    with dtcp.config.layer_work(None, [32, 8, 128]):
        assert dtcp.config.attention_heads == (32, 8, 128)
        with dtcp.config.layer_work(None, (4, 4, 8)):  # (a value in force stands)
            assert dtcp.config.attention_heads == (32, 8, 128)
    assert dtcp.config.attention_heads is None


# ---- ring_attention(layout="balanced", cu_seqlens=...) ------------------------------------------------


def balanced_by_boundaries_errors(docs, spec, window=(-1, -1)):
    """ring_attention with layout `spec` ("balanced[@k]") and the boundaries as cu_seqlens, the
    inputs sharded with Balanced.from_cu_seqlens: errors against one process."""
    named = dtcp.layout_from_spec(spec)
    cu = torch.tensor(_cu(docs), dtype=torch.int32)
    layout = dtcp.Balanced.from_cu_seqlens(cu, min_chunk=named.min_chunk, hidden_steps=named.hidden_steps)
    s = sum(docs)
    g = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(1, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, _ = reference_attention(*ref, mask=window_doc_mask(s, is_causal=True, window=window,
                                                                cu_seqlens=cu.tolist()))
    out_ref.backward(dout)
    local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = dtcp.ring_attention(*local, layout=spec, cu_seqlens=cu, is_causal=True, enable_gqa=True,
                              window_size=window, strategy="ring")
    out.backward(layout.shard(dout, dim=2))
    got = (out, *(t.grad for t in local))
    want = (out_ref, *(t.grad for t in ref))
    return {key: exact_err(a, layout.shard(b, dim=2)) for key, a, b in zip(KEYS, got, want)}


@pytest.mark.parametrize("n,docs,spec,window", [
    (2, (21, 3, 5, 3), "balanced@1", (-1, -1)),     # the 21 is cut
    (4, (40, 3, 3, 2, 9, 7), "balanced@1", (5, 0)),
    (4, (40, 3, 3, 2, 9, 7), "balanced", (-1, -1)),  # min_chunk 512: nothing cut, pieces split at rank ends
    # placements that differ with every step's host time hidden (the documents cut over windows)
    (4, (56, 7, 7, 8, 17, 9, 9, 9, 32, 14), "balanced@4+4", (-1, -1)),
    (4, (56, 7, 7, 8, 17, 9, 9, 9, 32, 14), "balanced@4", (-1, -1)),
    (4, (47, 13, 32, 72), "balanced@8+4", (9, 0)),
    (4, (47, 13, 32, 72), "balanced@8+2", (-1, -1)),
])
def test_ring_attention_balanced_by_boundaries_exact(n, docs, spec, window):
    for r in run_ranks(n, balanced_by_boundaries_errors, docs, spec, window):
        assert max(r.values()) < 1e-10, r


def auto_misuse():
    x = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
    out = []
    for layout, kwargs in (("auto", {}), ("balanced", {})):
        try:
            dtcp.ring_attention(x, x, x, layout=layout, is_causal=True, **kwargs)
        except ValueError as e:
            out.append(str(e))
    return out


def test_auto_and_balanced_without_documents_raise_on_every_rank():
    for r in run_ranks(2, auto_misuse):
        assert len(r) == 2 and "chosen per batch" in r[0] and "pass cu_seqlens" in r[1], r


# ---- dtcp.context_parallel(layout="auto") -------------------------------------------------------------


def kernel_bound_machine():
    """Cost-model constants under which tiny CPU calls weigh like long GPU ones: kernels at 1
    MFLOP/s, no host or link costs, so that the slowest rank's work decides (the placement choice
    of layout="auto" flips on the small mixes these tests run)."""
    from dataclasses import replace

    from dtcp.plan.cost import MACHINES

    return replace(MACHINES["h200-nvlink"], name="kernel-bound", kernel_flops_per_s=1e6, kernel_rates=(),
                   launch_host_s=(), fixed_s=(), call_overhead_s=0.0, latency_s=0.0, ring_launch_host_s=0.0)


def context_parallel_auto(docs, b, objective="auto", min_chunk=1, heads=None):
    """A layer's projections and F.scaled_dot_product_attention inside dtcp.context_parallel with
    layout="auto" and the batch's documents, under `objective` (dtcp.config.cost_objective) and,
    with `heads`, dtcp.config.attention_heads = heads and the kernel-bound cost machine: the
    layout it chose, and the errors of the output and of every gradient against the same layer on
    one process (documents masked)."""
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    s = sum(docs) if docs else 8 * n
    cu = None if docs is None else torch.tensor(_cu(docs), dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(b, s, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, 48, generator=g, dtype=torch.float64)

    def layer(x, w):  # x: (B, S', 16) -> (B, 4, S', 8), causal
        q, k, v = (x @ w).view(x.shape[0], x.shape[1], 3, 4, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    q, k, v = (xr @ wr).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
    mask = window_doc_mask(s, is_causal=True, window=(-1, -1), cu_seqlens=None if cu is None else cu.tolist())
    ref, _ = reference_attention(q, k, v, mask=mask)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    kwargs = {} if cu is None else {"cu_seqlens": cu}
    placing = {} if heads is None else {"attention_heads": heads, "cost_machine": kernel_bound_machine(),
                                        "auto_placement": "fastest"}
    with dtcp.config.override(cost_objective=objective, **placing), \
            dtcp.context_parallel(mesh, [xl], [1], layout=dtcp.Auto(min_chunk=min_chunk), **kwargs) as cp:
        out = layer(xl, wl)
        out.backward(cp.layout.shard(dout, cp.group, 2))
        chosen = cp.layout
    # (x's gradient is the full one after the block: each shard's, gathered on exit)
    errs = {"out": exact_err(out, chosen.shard(ref.detach(), cp.group, 2)), "dx": exact_err(xl.grad, xr.grad)}
    dw = wl.grad.clone()
    dist.all_reduce(dw)  # each rank's rows' share of the weight gradient
    errs["dw"] = exact_err(dw, wr.grad)
    return {"layout": chosen.name, "hidden_steps": getattr(chosen, "hidden_steps", None),
            "spec": chosen.op_spec() if isinstance(chosen, dtcp.Balanced) else chosen.spec(),
            "work": list(chosen.rank_work(n)) if isinstance(chosen, dtcp.Balanced) else None, **errs}


@pytest.mark.parametrize("n,docs,b,want", [
    (2, (21, 3, 5, 3), 1, "balanced"),
    (4, (40, 3, 3, 2, 9, 7), 2, "balanced"),   # documents shared by both rows: Balanced too
    (2, None, 1, "zigzag"),
])
def test_context_parallel_auto_exact(n, docs, b, want):
    for r in run_ranks(n, context_parallel_auto, docs, b):
        assert r["layout"] == want, r
        assert max(r[key] for key in ("out", "dx", "dw")) < 1e-10, r
        assert r["hidden_steps"] == (0 if want == "balanced" else None), r  # ("auto" without layer work: "call")


def context_parallel_objective_per_rank(docs):
    """Rank 0 under cost_objective "device", the others under "call": their placements differ."""
    try:
        context_parallel_auto(docs, 1, "device" if dist.get_rank() == 0 else "call", 4)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_context_parallel_auto_objectives_that_differ_between_ranks_raise_on_every_rank():
    """Ranks configured apart shard the batch apart: the attention call's agreement names the
    layout each has, on every rank, instead of a wrong answer or a hang."""
    for r in run_ranks(2, context_parallel_objective_per_rank, (56, 7, 7, 8, 17, 9, 9, 9, 32, 14)):
        assert r.startswith("PeerMismatchError") and "layout: rank 0 balanced@4+2, rank 1 balanced@4." in r, r


def test_context_parallel_auto_places_for_the_device_objective():
    """Under cost_objective="device" the batch is placed with every ring step's host time hidden
    (hidden_steps = N: its documents cut over windows, where "call" keeps them whole), exact."""
    docs = (56, 7, 7, 8, 17, 9, 9, 9, 32, 14)
    for r in run_ranks(4, context_parallel_auto, docs, 1, "device", 4):
        assert r["layout"] == "balanced" and r["hidden_steps"] == 4, r
        assert max(r[key] for key in ("out", "dx", "dw")) < 1e-10, r


@pytest.mark.parametrize("n,docs,want", [
    ((4, (56, 7, 7, 8, 17, 9, 9, 9, 32, 14), "balanced@4+4")),  # the ring's placement: 1.33x the mean's work
    ((2, (17, 10, 5, 32), "balanced@4+2")),                     # 1.41x
    ((2, (17, 8, 39), "balanced@4")),                           # 1.01x: nothing to gain, the ring's
])
def test_context_parallel_auto_places_for_the_fastest_strategy_exact(n, docs, want):
    """With dtcp.config.auto_placement = "fastest" and attention_heads (and a cost machine whose
    kernels dominate these tiny calls), layout="auto" shards a batch whose ring placement leaves a rank well above the mean's
    work with the placement balancing the work alone (every step hidden); exact either way."""
    # (heads given as 4 of 8 dims: what FA4 serves on the GPU the cost machine describes, where 4
    # dims would be predicted for the math kernel, which computes whole blocks)
    for r in run_ranks(n, context_parallel_auto, docs, 1, "call", 4, (4, 4, 8)):
        assert r["spec"] == want, r
        assert max(r[key] for key in ("out", "dx", "dw")) < 1e-10, r
        if want != "balanced@4":
            assert max(r["work"]) / (sum(r["work"]) / n) < 1.06, r


def context_parallel_heads_on_rank_0(docs):
    """auto_placement="fastest" (with attention_heads) on rank 0 only: its placement differs from the others'."""
    try:
        context_parallel_auto(docs, 1, "call", 4, (4, 4, 8) if dist.get_rank() == 0 else None)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_context_parallel_auto_heads_set_on_one_rank_raise_on_every_rank():
    """Ranks configured apart shard the batch apart: the attention call's agreement names the
    layout each has. (A mix of its own: a rank that had agreed on one of the two routes before
    would not agree again, and the pair would wait for each other until timeout_s, the
    per-route agreement's documented limit: docs/guide/failures.md.)"""
    for r in run_ranks(2, context_parallel_heads_on_rank_0, (15, 12, 5, 32)):
        assert r.startswith("PeerMismatchError") and "rank 0 balanced@4+2, rank 1 balanced@4" in r, r


# ---- transformers: auto by default, compiled, a new document mix every step -------------------------


MIXES = ((19, 5, 3, 5), (2, 2, 28), (10, 10, 6, 4, 2), (16, 16), (7, 1, 1, 1, 22))
# (64 tokens over 2 ranks, min_chunk 4: each placed otherwise with both ring steps' host time hidden)
HIDDEN_MIXES = ((17, 8, 39), (33, 21, 10), (19, 10, 30, 1, 4), (31, 33), (17, 10, 5, 32))


# (64 tokens over 2 ranks, min_chunk 4, the kernel-bound cost machine: placed in turn for the ring and,
# where the ring's placement leaves one rank 1.2-1.4x the mean's work, balancing the work alone)
FASTEST_MIXES = ((17, 10, 5, 32), (17, 8, 39), (19, 5, 3, 5, 32), (33, 21, 10), (9, 9, 14, 32), (31, 33))


def hf_compiled_new_documents_every_step(mixes=MIXES, objective="auto", layout="auto", machine=None,
                                         placement="ring"):
    """A tiny Llama, attn_implementation="dtcp", compiled once (aot_eager, fullgraph): each step a
    packed row of a new document mix (another number of documents, the same length) through the
    integration's default layout ("auto" -> Balanced), under `objective`
    (dtcp.config.cost_objective). Logits and every parameter gradient equal eager's; no graph
    break, one compile for all steps."""
    import transformers
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import dtcp.integrations.transformers as dtcp_hf

    torch._dynamo.reset()
    counters.clear()
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="dtcp", dtype=torch.float64)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="dtcp", dtype=torch.float64)
    model.load_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    coll = transformers.DataCollatorWithFlattening(return_tensors="pt")
    errs, frames, layouts, hidden, specs = [], [], [], set(), []
    for docs in mixes:
        batch = dict(coll([{"input_ids": torch.randint(0, 64, (d,), generator=g).tolist()} for d in docs]))
        grads = []
        for net, runner in ((eager, eager), (model, compiled)):
            net.zero_grad()
            with dtcp.config.override(cost_objective=objective, cost_machine=machine, auto_placement=placement), \
                    dtcp_hf.context_parallel(net, mesh, batch, layout=layout) as cp:
                out = runner(**cp.inputs)
                out.loss.backward()
                logits = cp.gather(out.logits.detach())
            dtcp_hf.sum_gradients(net, cp.group)
            grads.append((logits, [p.grad.clone() for p in net.parameters()]))
            layouts.append(cp.layout.name)
            hidden.add(cp.layout.hidden_steps)
            specs.append(cp.layout.op_spec())
        (le, ge), (lc, gc) = grads
        errs += [exact_err(lc, le)] + [exact_err(a, b) for a, b in zip(gc, ge)]
        frames.append(counter.frame_count)
    return {"max_err": max(errs), "frames": frames, "graph_breaks": sum(counters["graph_break"].values()),
            "layouts": sorted(set(layouts)), "hidden_steps": sorted(hidden), "specs": specs[::2]}


def test_transformers_auto_compiled_new_documents_every_step():
    pytest.importorskip("transformers")
    for r in run_ranks(2, hf_compiled_new_documents_every_step, timeout=400):
        assert r["layouts"] == ["balanced"], r
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["frames"] == [1] * len(r["frames"]), r  # a new document mix is no recompile
        assert r["hidden_steps"] == [0], r  # ("auto" -> "step": this tiny model's layer work hides no ring step)


def test_transformers_auto_compiled_for_the_device_objective():
    """The same under cost_objective="device" with Auto(min_chunk=4): every batch placed with both
    ring steps' host time hidden (each of these mixes placed otherwise than with none), still one
    compile for all steps, no graph break, equal to eager."""
    pytest.importorskip("transformers")
    for r in run_ranks(2, hf_compiled_new_documents_every_step, HIDDEN_MIXES, "device", dtcp.Auto(min_chunk=4),
                       timeout=400):
        assert r["layouts"] == ["balanced"] and r["hidden_steps"] == [2], r
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["frames"] == [1] * len(r["frames"]), r


def test_transformers_auto_compiled_places_for_the_fastest_strategy():
    """Under auto_placement="fastest" the integration gives layout="auto" the model's heads (4/2 of
    8: dtcp.config.attention_heads inside its block), so that each batch is placed for the
    strategy predicted fastest on it: with
    the kernel-bound cost machine, the ring's placement or the one balancing the work alone, in
    turn. Compiled (aot_eager, fullgraph): equal to eager on every step, no graph break, and one
    compile per placement kind (the attention calls take one Balanced without documents per kind),
    not one per batch."""
    pytest.importorskip("transformers")
    for r in run_ranks(2, hf_compiled_new_documents_every_step, FASTEST_MIXES, "call", dtcp.Auto(min_chunk=4),
                       kernel_bound_machine(), "fastest", timeout=400):
        assert r["specs"] == ["balanced@4+2", "balanced@4", "balanced@4+2", "balanced@4", "balanced@4+2",
                              "balanced@4"], r
        assert r["graph_breaks"] == 0 and r["max_err"] < 1e-12, r
        assert r["frames"] == [1, 2, 2, 2, 2, 2], r
