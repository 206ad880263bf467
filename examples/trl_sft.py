"""TRL's SFTTrainer with packing and dtcp's context parallelism: one switch, `context_parallel=`.

    torchrun --nproc-per-node 4 examples/trl_sft.py --cp 2 --check                 # CPU, gloo: dp 2 x cp 2
    torchrun --nproc-per-node 8 examples/trl_sft.py --cp 4 --model /path/to/ckpt   # GPUs, NCCL

`SFTTrainer(packing=True)` packs the documents into rows of `--max-length` tokens (best-fit
decreasing) and trains padding-free: one flattened row per step whose position ids restart at
each document. TRL refuses packing under accelerate's context parallelism (its CP drops the
mask); under dtcp's, each document attends only to itself, exactly. The model is a small Llama
from its config (or `--model`, any causal LM checkpoint with its tokenizer). `--check` trains the
same model on the same global batches with the same SFTTrainer without CP in one process of its
own and compares the logged losses step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers

import dtcp.integrations.transformers as dtcp_hf   # registers attn_implementation="dtcp"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (dp = world size / cp)")
    p.add_argument("--model", default=None, help="a checkpoint path or hub name; default: a tiny Llama from config")
    p.add_argument("--docs", type=int, default=96, help="training documents (random tokens)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per packed row")
    p.add_argument("--batch", type=int, default=2, help="packed rows per cp group per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layout", default="zigzag", help="zigzag | contiguous")
    p.add_argument("--dtype", default=None, help="float32 | float64 | bfloat16 (default: bfloat16 on GPU, float64 on CPU)")
    p.add_argument("--check", action="store_true", help="also train without CP and compare the losses")
    p.add_argument("--reference-dp", type=int, default=1, help=argparse.SUPPRESS)   # --check's own run
    return p.parse_args()


def tiny_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def build(args, dtype):
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        return model, transformers.AutoTokenizer.from_pretrained(args.model)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype), tiny_tokenizer(256)


def train(args, cp: int, dtype, out_dir: str, dp: int):
    import datasets
    import trl

    model, tokenizer = build(args, dtype)
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(8, args.max_length // 2, (args.docs,), generator=g).tolist()
    data = datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(2, model.config.vocab_size, (k,), generator=g).tolist() for k in lens]})
    sft = trl.SFTConfig(
        output_dir=out_dir, packing=True, max_length=args.max_length, per_device_train_batch_size=args.batch * dp,
        max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        router_aux_loss_coef=0.0, dataloader_drop_last=True,
        ddp_backend=None if cp == 1 else ("nccl" if torch.cuda.is_available() else "gloo"))
    SFTTrainer = dtcp_hf.with_context_parallel(trl.SFTTrainer)   # the only change to an SFT script ...
    trainer = SFTTrainer(model=model, args=sft, train_dataset=data, processing_class=tokenizer,
                         context_parallel=dtcp_hf.ContextParallelConfig(cp_size=cp, layout=args.layout) if cp > 1 else None)
    trainer.train()                                               # ... and this argument
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def reference_losses(dp: int) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    if torch.cuda.is_available():
        # One GPU, this rank's: a Trainer that sees several outside torchrun wraps the model in
        # nn.DataParallel, and then logs its loss times the GPU count (n_gpu; seen on 2 H100s: 2x).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = devices[int(os.environ.get("LOCAL_RANK", 0))]
    argv = [a for a in sys.argv[1:] if a != "--check"] + ["--cp", "1", "--reference-dp", str(dp)]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.split("LOSSES ", 1)[1].splitlines()[0])


def main():
    args = parse()
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float64)
    with tempfile.TemporaryDirectory() as out:
        losses, trainer = train(args, args.cp, dtype, out, dp=args.reference_dp)
    if args.reference_dp > 1 or args.cp == 1:
        print("LOSSES " + json.dumps(losses), flush=True)
        return
    world, rank = trainer.args.world_size, trainer.args.process_index
    dp = world // args.cp
    if rank == 0:
        print(f"dp {dp} x cp {args.cp}: losses {[round(x, 6) for x in losses]}", flush=True)
    if args.check and rank == 0:
        ref = reference_losses(dp)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        # Trainer logs through a float32 accumulator; TRL's fused LM head accumulates in float32
        # (bf16: 1e-3, as examples/train_llama.py and the Trainer example)
        tol = 1e-5 if dtype in (torch.float64, torch.float32) else 1e-3
        print(f"without CP, one process: losses {[round(x, 6) for x in ref]}", flush=True)
        print(f"check: worst relative loss difference {worst:.2e} (tolerance {tol:g})", flush=True)
        if worst > tol or len(ref) != len(losses):
            raise SystemExit(f"check failed: {worst:.2e} > {tol:g}")


if __name__ == "__main__":
    main()
