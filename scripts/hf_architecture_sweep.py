"""Every causal LM architecture transformers ships, under dtcp's context parallelism.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/hf_architecture_sweep.py            # all of them
    PYTHONPATH=$PWD python scripts/hf_architecture_sweep.py llama mistral --json out.json

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that builds from a tiny config (hidden 32,
2 layers, vocab 64, float64), on 2 gloo ranks, zigzag, forward only:

* plain: a (2, 32) batch, against the same weights run in one process with HF's eager attention;
* packed: 4 documents packed into one row of 32 (``DataCollatorWithFlattening``'s position ids),
  against each document run on its own in one process.

Each case ends as one of: ``exact`` (max abs logits error < 1e-10), ``refused`` (every rank
raised; the first line of the message is shown), or a failure: ``WRONG`` (an answer beyond
1e-10), ``ONE-RANK`` (only some ranks raised), ``HANG``. Architectures that do not build from the
tiny config (or whose forward fails in one process too) are counted apart as ``unbuilt``.
Casts of float64 tensors to float32 (HF's eager softmax, RMSNorms, routers) are skipped in both
runs (`_f64_everywhere`), so that the comparison is float64 throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

SEQ = 32
DOCS = [5, 11, 7, 9]           # a boundary on the shard boundary (16 of 32 is 5+11)
VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_dropout=0.0, hidden_dropout=0.0,
            dropout=0.0, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=6, attention_chunk_size=8,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1, num_shared_experts=1,
            n_shared_experts=1, ffn_hidden_size=64, d_model=32, d_ff=64)


def _f64_everywhere():
    """Keep float64 models in float64: HF's eager softmax (dtype=float32), RMSNorms and routers
    (``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``) cast to float32, which turns float64 rounding differences
    (the packed reference runs each document alone: other shapes, other summation orders) into
    float32 ones. Applied to the reference and to dtcp alike."""
    if getattr(torch.Tensor.to, "_f64", False):
        return
    to, flt, typ = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type
    low = (torch.float32, torch.float16, torch.bfloat16)

    def to_f64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            if kwargs.get("dtype") in low:
                kwargs.pop("dtype")
            args = tuple(a for a in args if not (isinstance(a, torch.dtype) and a in low))
            if not args and not kwargs:
                return self
        return to(self, *args, **kwargs)

    def float_f64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else flt(self, *args, **kwargs)

    def type_f64(self, dtype=None, *args, **kwargs):
        if self.dtype == torch.float64 and dtype in low:
            return self
        return typ(self, dtype, *args, **kwargs) if dtype is not None else typ(self)

    to_f64._f64 = True
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to_f64, float_f64, type_f64
    softmax = F.softmax

    def softmax_f64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    F.softmax = softmax_f64
    torch.nn.functional.softmax = softmax_f64


# Overrides tried in turn on top of TINY, until the model builds and runs one process: no GQA
# (MLA-style attention), the architecture's own head dim, a rotary dim that fits a head of 8.
VARIANTS = ({}, {"num_key_value_heads": 4}, {"num_key_value_heads": 4, "head_dim": None},
            {"num_key_value_heads": 4, "rotary_dim": 4, "partial_rotary_factor": 0.5})


def _has(config, key: str) -> bool:
    """Whether `config` has a settable field `key` (not a read-only property, not per-layer)."""
    prop = getattr(type(config), key, None)
    if isinstance(prop, property) and prop.fset is None:
        return False
    try:
        return hasattr(config, key) and not callable(getattr(config, key))
    except Exception:  # noqa: BLE001 - e.g. transformers' per-layer attributes raise on global access
        return False


def _small(config, variant: dict) -> dict:
    sizes = {**TINY, **variant}
    kw = {k: v for k, v in sizes.items() if v is not None and _has(config, k)}
    types = getattr(config, "layer_types", None) if _has(config, "layer_types") else None
    if types:   # keep the architecture's kinds of layer, two of them (distinct ones first)
        kinds = list(dict.fromkeys(types))
        kw["layer_types"] = (kinds + [types[0]])[:2] if len(kinds) < 2 else kinds[:2]
    return kw


def tiny_config(model_type: str, variant: dict = VARIANTS[0]):
    """The architecture's config with every size field it has set small (sub-configs too)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    kw = _small(base, variant)
    for name in getattr(cls, "sub_configs", None) or {}:
        value = getattr(base, name, None)
        if value is not None and hasattr(value, "to_dict"):
            kw[name] = {**value.to_dict(), **_small(value, variant)}
    return cls(**kw)


def build(model_type: str, impl: str, seed: int = 0, variant: dict = VARIANTS[0]):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    cls = getattr(transformers, names[model_type])
    cfg = tiny_config(model_type, variant)
    torch.manual_seed(seed)
    try:
        model = cls._from_config(cfg, attn_implementation=impl, dtype=torch.float64, experts_implementation="eager")
    except (TypeError, ValueError) as e:
        if "experts" not in str(e):
            raise
        model = cls._from_config(cfg, attn_implementation=impl, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # move every parameter off its init (zero-init gates, sinks, biases matter)
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def batches(kind: str):
    g = torch.Generator().manual_seed(1)
    if kind == "plain":
        return {"input_ids": torch.randint(3, VOCAB, (2, SEQ), generator=g)}
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos}


def reference_logits(model, kind: str, batch):
    with torch.no_grad():
        if kind == "plain":
            return model(**batch, use_cache=False).logits
        out, start = [], 0
        for n in DOCS:   # each document alone, with the positions the packed row gives it
            out.append(model(input_ids=batch["input_ids"][:, start:start + n],
                             position_ids=batch["position_ids"][:, start:start + n], use_cache=False).logits)
            start += n
        return torch.cat(out, 1)


_MESH: dict = {}


def case(model_type: str, kind: str) -> dict:
    """On every rank: the one-process reference, then the block. Returns what happened here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import transformers

    import dtcp.integrations.transformers as dtcp_hf

    _f64_everywhere()
    transformers.logging.set_verbosity_error()
    batch = batches(kind)
    for variant in VARIANTS:
        try:
            ref = build(model_type, "eager", variant=variant)
            want = reference_logits(ref, kind, batch)
            break
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    else:
        return {"status": "unbuilt", "why": why}
    try:
        model = build(model_type, "dtcp", variant=variant)
        built = "dtcp"
    except Exception as e:  # noqa: BLE001 - transformers refuses the custom attention: the block must refuse
        model, built = ref, f"eager ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
    model.load_state_dict(ref.state_dict())
    n = dist.get_world_size()
    if n not in _MESH:
        _MESH[n] = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    try:
        with torch.no_grad(), dtcp_hf.context_parallel(model, _MESH[n], batch) as cp:
            out = model(**cp.inputs)
            got = cp.gather(out.logits)
    except Exception as e:  # noqa: BLE001
        return {"status": "raised", "built": built, "why": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    if got.shape != want.shape:
        return {"status": "ran", "built": built, "err": float("inf"), "scale": 0.0}
    return {"status": "ran", "built": built, "err": (got - want).abs().max().item(),
            "scale": want.abs().max().item()}


def verdict(per_rank: list) -> dict:
    first = per_rank[0]
    statuses = {r["status"] for r in per_rank}
    if statuses == {"unbuilt"}:
        return {"result": "unbuilt", "why": first["why"]}
    if statuses == {"raised"}:
        return {"result": "refused", "why": first["why"]}
    if statuses == {"ran"}:
        err = max(r["err"] for r in per_rank)
        return {"result": "exact" if err < 1e-10 else "WRONG", "err": err, "built": first["built"]}
    return {"result": "ONE-RANK", "ranks": per_rank}


def main(argv=None) -> int:
    from dist_harness import get_pool
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal LM in transformers)")
    p.add_argument("--kinds", default="plain,packed")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    types = args.types or list(names)
    results = {}
    t0 = time.time()
    for mt in types:
        for kind in args.kinds.split(","):
            try:
                res = verdict(get_pool(args.ranks).run(case, mt, kind, timeout=args.timeout))
            except TimeoutError as e:
                res = {"result": "HANG", "why": str(e).splitlines()[0]}
            except AssertionError as e:
                res = {"result": "CRASH", "why": traceback.format_exception_only(e)[-1][-300:]}
            results[f"{mt}/{kind}"] = res
            detail = f"{res['err']:.1e}" if "err" in res else res.get("why", "")
            print(f"{mt:28s} {kind:7s} {res['result']:8s} {detail}", flush=True)
    counts: dict = {}
    for res in results.values():
        counts[res["result"]] = counts.get(res["result"], 0) + 1
    archs = {}
    for key, res in results.items():
        archs.setdefault(key.split("/")[0], []).append(res["result"])
    arch_counts: dict = {}
    for rs in archs.values():
        label = rs[0] if len(set(rs)) == 1 else "+".join(sorted(set(rs)))
        arch_counts[label] = arch_counts.get(label, 0) + 1
    print(f"\n{len(types)} architectures, {len(results)} cases in {time.time() - t0:.0f}s")
    print("cases:", json.dumps(counts, sort_keys=True))
    print("architectures:", json.dumps(arch_counts, sort_keys=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": results, "counts": counts, "architectures": arch_counts}, f, indent=1, sort_keys=True)
    bad = [k for k, r in results.items() if r["result"] in ("WRONG", "ONE-RANK", "HANG", "CRASH")]
    if bad:
        print("FAILURES:", " ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
