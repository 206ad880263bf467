"""transformers.Trainer with dtcp's context parallelism: one switch, `context_parallel=`.

    torchrun --nproc-per-node 4 examples/hf_trainer.py --cp 2 --check                 # CPU, gloo: dp 2 x cp 2
    torchrun --nproc-per-node 8 examples/hf_trainer.py --cp 4 --model /path/to/ckpt   # GPUs, NCCL

Packed variable-length documents through `DataCollatorWithFlattening` (padding-free: position ids
restart per document, so documents never see each other), a small Qwen2 from its config with a
sliding-window layer and a full one (or `--model`, any causal LM checkpoint), and the plain
`transformers.Trainer` with `context_parallel=ContextParallelConfig(cp_size=...)`: every cp group
gets the same batch, dtcp shards its sequence, and the loss, logs and checkpoints are those of
the same Trainer without CP. `--check` then trains the same model on the same global batches with
the same Trainer without CP in one process of its own, and compares the logged losses step by step.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import dtcp.integrations.transformers as dtcp_hf   # registers attn_implementation="dtcp"
from dtcp.integrations.transformers.trainer import with_context_parallel


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (dp = world size / cp)")
    p.add_argument("--model", default=None, help="a checkpoint path or hub name; default: a tiny Qwen2 from config")
    p.add_argument("--docs", type=int, default=64, help="training documents (random tokens)")
    p.add_argument("--batch", type=int, default=4, help="documents per cp group per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layout", default="zigzag", help="zigzag | contiguous (fewest rounds for sliding windows)")
    p.add_argument("--dtype", default=None, help="float32 | float64 | bfloat16 (default: bfloat16 on GPU, float64 on CPU)")
    p.add_argument("--check", action="store_true", help="also train without CP and compare the losses")
    p.add_argument("--reference-dp", type=int, default=1, help=argparse.SUPPRESS)   # --check's own run
    return p.parse_args()


def build_model(args, dtype):
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    cfg = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, use_sliding_window=True, sliding_window=48,
        max_window_layers=1, layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
        use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def documents(n: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 160, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, vocab, (k,), generator=g).tolist()} for k in lens]


def train(args, cp: int, dtype, out_dir: str, dp: int):
    model = build_model(args, dtype)
    data = documents(args.docs, model.config.vocab_size)
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch * (dp if cp == 1 else 1), max_steps=args.steps,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if cp == 1 else ("nccl" if torch.cuda.is_available() else "gloo"))
    Trainer = with_context_parallel(transformers.Trainer)   # the only change to a Trainer script ...
    trainer = Trainer(model=model, args=targs, train_dataset=data,
                      data_collator=transformers.DataCollatorWithFlattening(),
                      context_parallel=dtcp_hf.ContextParallelConfig(cp_size=cp, layout=args.layout) if cp > 1 else None)
    trainer.train()                                         # ... and this argument
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def reference_losses(dp: int) -> list[float]:
    """The same Trainer without CP in a process of its own (no torchrun environment), on the whole
    global batch: dp cp groups' batches at once."""
    import json
    import os
    import subprocess
    import sys

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
        import json

        print("LOSSES " + json.dumps(losses), flush=True)
        return
    world, rank = trainer.args.world_size, trainer.args.process_index
    dp = world // args.cp
    if rank == 0:
        print(f"dp {dp} x cp {args.cp}: losses {[round(x, 6) for x in losses]}", flush=True)
    if args.check and rank == 0:
        ref = reference_losses(dp)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        # Trainer logs through a float32 accumulator, and HF's own loss casts the logits to float32
        # (bf16: 1e-3, as examples/train_llama.py; measured 2.3e-5 on 2 H200s)
        tol = 1e-6 if dtype in (torch.float64, torch.float32) else 1e-3
        print(f"without CP, one process: losses {[round(x, 6) for x in ref]}", flush=True)
        print(f"check: worst relative loss difference {worst:.2e} (tolerance {tol:g})", flush=True)
        if worst > tol or len(ref) != len(losses):
            raise SystemExit(f"check failed: {worst:.2e} > {tol:g}")


if __name__ == "__main__":
    main()
