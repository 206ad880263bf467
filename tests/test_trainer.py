"""The Trainer path: ``transformers.Trainer`` and TRL's ``SFTTrainer`` with dtcp's context
parallelism, on 4 spawned gloo ranks (dp 2 x cp 2, DDP over the 4 ranks, as ``torchrun`` launches
them), against the same trainer without context parallelism on one process (float64): every
micro-step's loss, the evaluation loss and every final parameter to 1e-10. Llama (padding,
gradient accumulation, evaluation), Mistral with a window larger than a shard (padding-free
packing with ``DataCollatorWithFlattening``, gradient checkpointing), gpt-oss (sinks),
``SFTTrainer(packing=True)``; and the refusals, on every rank."""

from __future__ import annotations

import os
import tempfile

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dist_harness import run_ranks  # noqa: E402

dtcp_hf = pytest.importorskip("dtcp.integrations.transformers")
from dtcp.integrations.transformers import trainer as cp_trainer  # noqa: E402
from test_transformers import COMMON, VOCAB, build, f64_causal_lm_loss  # noqa: E402

DP, CP = 2, 2
WORLD = DP * CP


# ---- float64 stand-in for TRL's fused LM head kernel (float32 inside) --------------------------------------


class _F64LogProb(torch.autograd.Function):
    """``trl.kernels.ChunkedLogProbFunction``'s contract (hidden (N, H), weight (V, H), bias, targets
    (N,) -> log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) in float64 with autograd;
    TRL's kernel accumulates in float32, which would cap any float64 comparison at ~1e-7. Test-only,
    like test_transformers' float64 loss."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        z = hidden @ weight.t()
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        logp = torch.log_softmax(z / temperature, dim=-1)
        lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1).detach() if "entropy" in outputs else None
        top1 = (z.argmax(-1) == targets).to(z.dtype).detach() if "is_top1" in outputs else None
        return lp, entropy, None, None, top1


try:
    import trl.trainer.utils as _trl_utils

    _trl_utils._ChunkedLogProbFunction = _F64LogProb
except ImportError:
    _trl_utils = None


# ---- models and data ---------------------------------------------------------------------------------------


def make_model(name: str):
    if name == "mistral_window":   # window 20 > the 16-token shards of 32-token rows on 2 cp ranks
        cfg = transformers.MistralConfig(**COMMON, sliding_window=20, use_cache=False)
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float64)
    else:
        # not "dtcp" on purpose: the trainer switches it (gpt-oss has no sdpa)
        model = build(name, "eager" if name == "gpt_oss" else "sdpa")
        model.config.use_cache = False
    model.loss_function = f64_causal_lm_loss   # HF's loss casts logits to float32
    return model


def documents(n: int, seed: int, lo: int = 5, hi: int = 26) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in lens]


def pad_collate(features):
    """A user's padding collator: right padding, attention_mask, labels -100 on padding."""
    s = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), s, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tokenizer():
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


CASES = {
    # name: (model, trainer, data, per-cp-group batch, gradient accumulation, extras)
    "llama_padded_ga_eval": ("llama", "trainer", "padded", 2, 2, {}),
    "mistral_window_packed_checkpointing": ("mistral_window", "trainer", "flatten", 2, 1,
                                            {"gradient_checkpointing": True, "layout": "contiguous"}),
    "gpt_oss_sinks_padded": ("gpt_oss", "trainer", "padded", 2, 1, {}),
    "sft_packing_llama": ("llama", "sft", "sft_packed", 2, 2, {}),
    "qwen2_packed_compiled": ("qwen2", "trainer", "flatten", 2, 1, {"compile": True}),
}


def make_trainer(case: str, cp: int, out_dir: str):
    name, kind, data, b, ga, extra = CASES[case]
    model = make_model(name)
    lens = (16, 17) if extra.get("compile") else (5, 26)   # compile: one shape per step, no recompilation
    docs = [{"input_ids": d, "labels": list(d)} for d in documents(16, 7, *lens)]
    eval_docs = [{"input_ids": d, "labels": list(d)} for d in documents(8, seed=8)]
    # one process takes the DP cp groups' batches at once: the same global batch in both runs
    common = dict(output_dir=out_dir, per_device_train_batch_size=b * DP, per_device_eval_batch_size=b * DP,
                  gradient_accumulation_steps=ga, max_steps=2, learning_rate=0.5, lr_scheduler_type="constant",
                  optim="sgd", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                  disable_tqdm=True, dataloader_num_workers=0)
    if extra.get("compile") and cp > 1:   # Trainer's torch.compile of the whole model (aot_eager: no C++ toolchain);
        # the one-process reference stays eager (compiling it too only costs CI time)
        common.update(torch_compile=True, torch_compile_backend="aot_eager")
    if extra.get("gradient_checkpointing"):
        common["activation_checkpointing"] = True
    if cp > 1:
        common["ddp_backend"] = "gloo"
    if cp > 1:   # the batch per cp group; the global batch is the same in both runs
        common.update(per_device_train_batch_size=b, per_device_eval_batch_size=b)
    cpc = dtcp_hf.ContextParallelConfig(cp_size=cp, layout=extra.get("layout", "zigzag")) if cp > 1 else None
    if kind == "trainer":
        collate = pad_collate if data == "padded" else transformers.DataCollatorWithFlattening()
        cls = cp_trainer.with_context_parallel(transformers.Trainer)
        return cls(model=model, args=transformers.TrainingArguments(**common), train_dataset=docs,
                   eval_dataset=eval_docs, data_collator=collate, context_parallel=cpc)
    import datasets
    import trl

    cls = cp_trainer.with_context_parallel(trl.SFTTrainer)
    sft_args = trl.SFTConfig(**common, packing=True, max_length=40, dataset_num_proc=None)
    # documents in complementary pairs (a, 40 - a), a > 20: best-fit-decreasing packs each pair into
    # one 40-token row, so the packed sets hold 8 and 4 rows, whole batches on one process and on
    # 2 dp groups (an uneven split repeats rows on some dp groups only, with or without CP)
    g = torch.Generator().manual_seed(9)

    def pairs(big):
        return [torch.randint(2, VOCAB, (k,), generator=g).tolist() for a in big for k in (a, 40 - a)]

    train = datasets.Dataset.from_dict({"input_ids": pairs([21, 23, 25, 27, 29, 31, 33, 35])})
    evals = datasets.Dataset.from_dict({"input_ids": pairs([22, 26, 30, 34])})
    return cls(model=model, args=sft_args, train_dataset=train, eval_dataset=evals, processing_class=tokenizer(),
               context_parallel=cpc)


class _Recorder:
    """Keeps every micro-step's loss (what training_step returns, float64) for the comparison."""

    def training_step(self, model, inputs, *args, **kwargs):
        self.full_lengths.append(inputs["input_ids"].shape[1])
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.micro_losses.append(float(loss.detach().double()))
        return loss


def run_case(case: str, cp: int) -> dict:
    """Train (and evaluate) `case`; on ranks, every rank's micro-step losses (its share times the
    world size, as Trainer returns them) and rank 0's final parameters."""
    dist_on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if dist_on else 1
    if dist_on:   # what torchrun sets
        rank = dist.get_rank()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(case, cp, out)
        trainer.__class__ = type("Recorded" + type(trainer).__name__, (_Recorder, type(trainer)), {})
        trainer.micro_losses, trainer.full_lengths, seen = [], [], []
        embed = trainer.model.get_input_embeddings()
        hook = embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]) if m.training else None)
        trainer.train()
        hook.remove()
        metrics = trainer.evaluate() if not CASES[case][5].get("compile") else {"eval_loss": 1.0}   # (eval recompiles)
        log = [h for h in trainer.state.log_history if "loss" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    attn = model.config._attn_implementation
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = torch.tensor(trainer.micro_losses, dtype=torch.float64)
    if dist_on:
        dist.all_reduce(losses)
        losses = losses / world   # Trainer's logged loss: the mean over every rank
    return {"losses": losses, "eval_loss": metrics["eval_loss"], "logged": [h["loss"] for h in log],
            "params": params, "attn": attn, "steps": trainer.state.global_step,
            "lengths": list(zip(trainer.full_lengths, seen))}


def compare(case: str):
    ranks = run_ranks(WORLD, run_case, case, CP, timeout=300)
    ref = run_case(case, 1)
    got = ranks[0]
    assert ref["steps"] == got["steps"] == 2
    assert got["attn"] == "dtcp"
    # context parallelism happened: each rank's forward saw its shard of the (padded) sequence only
    for r in ranks:
        assert all(local < full <= local * CP < full + 2 * CP for full, local in r["lengths"]), r["lengths"]
    assert len(ref["losses"]) == len(got["losses"]) == 2 * CASES[case][4]
    loss_err = ((got["losses"] - ref["losses"]).abs() / ref["losses"].abs()).max().item()
    eval_err = abs(got["eval_loss"] - ref["eval_loss"]) / abs(ref["eval_loss"])
    param_err = max(((got["params"][n] - p).abs().max() / p.abs().max().clamp(min=1e-30)).item()
                    for n, p in ref["params"].items())
    moved = max((ref["params"][n] - p).abs().max().item() for n, p in make_model(CASES[case][0]).named_parameters())
    for r in ranks[1:]:   # DDP keeps the replicas equal
        assert all(torch.equal(r["params"][n], p) for n, p in got["params"].items())
    print(f"{case}: losses {ref['losses'].tolist()} rel err {loss_err:.1e}; eval {eval_err:.1e}; "
          f"params {param_err:.1e} (moved {moved:.2e})")
    assert moved > 1e-3   # training changed the parameters: the comparison means something
    assert loss_err < 1e-10 and eval_err < 1e-10 and param_err < 1e-10, (loss_err, eval_err, param_err)
    # Trainer's own logs (its float32 accumulator) agree to float32 rounding
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got["logged"], ref["logged"]))


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_equals_one_process(case):
    if CASES[case][1] == "sft":
        pytest.importorskip("trl")
    compare(case)


# ---- refusals, on every rank --------------------------------------------------------------------------------


def refusals() -> dict:
    """Each refused configuration's error on this rank (type: message), or 'no error'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate.utils import ParallelismConfig

    cls = cp_trainer.with_context_parallel(transformers.Trainer)
    docs = [{"input_ids": d, "labels": list(d)} for d in documents(8, seed=7)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(output_dir=tmp, report_to=[], use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
                    max_steps=1, disable_tqdm=True, save_strategy="no")
        cases = {
            "accelerate_cp_too": (dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2},
                                       parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=2)), 2, {}),
            "cp_does_not_divide": ({}, 3, {}),
            "label_smoothing": (dict(label_smoothing_factor=0.1), 2, {}),
            "compute_loss_func": ({}, 2, dict(compute_loss_func=lambda outputs, labels, num_items_in_batch: 0)),
            "router_aux_loss": ({}, 2, {}),
            "eval_with_metrics": ({}, 2, dict(compute_metrics=lambda p: {})),
        }
        for case, (extra, cp, kw) in cases.items():
            try:
                model = make_model("gpt_oss" if case == "router_aux_loss" else "llama")
                if case == "router_aux_loss":
                    model.config.output_router_logits = True
                t = cls(model=model, args=transformers.TrainingArguments(**base, **extra), train_dataset=docs,
                        eval_dataset=docs, data_collator=pad_collate, context_parallel=cp, **kw)
                if case == "eval_with_metrics":
                    t.evaluate()
                out[case] = "no error"
            except Exception as e:  # noqa: BLE001
                out[case] = f"{type(e).__name__}: {e}"
    return out


NEEDLES = {
    "accelerate_cp_too": "use one context parallelism, not both",
    "cp_does_not_divide": "cp_size=3) must divide the world size 4",
    "label_smoothing": "label_smoothing_factor=0.1",
    "compute_loss_func": "compute_loss_func with dtcp",
    "router_aux_loss": "router_aux_loss_coef=0.0",
    "eval_with_metrics": "each rank holds its shard of the logits",
}


def test_refusals_raise_on_every_rank():
    results = run_ranks(WORLD, refusals, timeout=300)
    for case, needle in NEEDLES.items():
        msgs = [r[case] for r in results]
        assert all(needle in m for m in msgs), (case, msgs)
