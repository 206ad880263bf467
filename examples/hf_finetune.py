"""Fine-tune a Hugging Face causal LM with FSDP2 over dp and dtcp context parallelism over cp.

    torchrun --nproc-per-node 4 examples/hf_finetune.py --cp 2 --steps 8 --check          # CPU, gloo
    torchrun --nproc-per-node 8 examples/hf_finetune.py --cp 4 --model /path/to/checkpoint --compile  # GPUs, NCCL

Every dp group gets its own packed batch of variable-length documents (DataCollatorWithFlattening:
position ids restart per document, labels -100 on each document's first token); the cp ranks of a
dp group get the same full batch, and `dtcp.integrations.transformers.context_parallel` shards it:
global position ids, labels shifted before sharding, global document boundaries, and a
`num_items_in_batch` counted over the whole global batch (all dp groups), so each rank's
`out.loss` is its share of the global token-mean loss and the *sum* of all ranks' gradients is its
gradient. FSDP2 shards the parameters over (dp, cp) as HSDP (replicate over dp, shard over cp)
with gradient divide factor 1 (a sum). `--check` trains a copy of the model without CP or FSDP
on the same global batches in every process and compares the losses step by step.

Without --model the model is a small Qwen2 built from its config, with a sliding-window layer and a
full one (no download); with --model it is `AutoModelForCausalLM.from_pretrained(path)`.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformers
import dtcp
import dtcp.integrations.transformers as dtcp_hf   # registers attn_implementation="dtcp"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (dp = world size / cp)")
    p.add_argument("--model", default=None, help="a checkpoint path or hub name; default: a tiny Qwen2 from config")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence (a multiple of 2*cp)")
    p.add_argument("--batch", type=int, default=1, help="packed sequences per dp group per step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layout", default="zigzag", help="zigzag | contiguous (fewest rounds for sliding windows)")
    p.add_argument("--dtype", default=None, help="float32 | float64 | bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--check", action="store_true", help="also train without CP and compare the losses")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def tiny_config(vocab: int):
    return transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, use_sliding_window=True, sliding_window=48,
        max_window_layers=1, layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0)


def documents(step: int, dp_rank: int, batch: int, seq_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random documents (lengths 8..seq_len/2) filling `batch` rows of exactly seq_len tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_rank)
    rows = []
    for _ in range(batch):
        left, docs = seq_len, []
        while left > 0:
            n = min(left, int(torch.randint(8, max(9, seq_len // 2), (1,), generator=g)))
            docs.append(torch.randint(0, vocab, (n,), generator=g).tolist())
            left -= n
        rows.append(docs)
    return rows


def packed_batch(rows, device) -> dict:
    coll = transformers.DataCollatorWithFlattening(return_tensors="pt")
    parts = [coll([{"input_ids": d} for d in docs]) for docs in rows]
    return {k: torch.cat([p[k] for p in parts]).to(device) for k in ("input_ids", "labels", "position_ids")}


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def main():
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} must divide the world size {world}")
    dp = world // args.cp
    mesh = init_device_mesh(device.type, (dp, args.cp), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh["dp"].get_local_rank()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)

    torch.manual_seed(args.seed)   # the same initial weights on every rank
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="dtcp", dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(256), attn_implementation="dtcp", dtype=dtype)
    model.to(device).train()
    vocab = model.config.vocab_size
    reference = copy.deepcopy(model) if args.check else None

    # FSDP2 as HSDP over (dp, cp): replicated over dp, sharded over cp. Each rank's gradient is its
    # share of the global loss's gradient, so the reduction is a sum (divide factor 1).
    layers = model.model.layers
    for layer in layers:
        if args.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in [*layers, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)   # plain SUM collectives (gloo has no PREMUL_SUM)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    layout = dtcp.layout_from_spec(args.layout)

    worst = 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        all_rows = [documents(step, r, args.batch, args.seq_len, vocab, args.seed) for r in range(dp)]
        batch = packed_batch(all_rows[dp_rank], device)
        # the loss is the token mean over the global batch: count the targets of every dp group
        n_items = sum(count_targets(packed_batch(rows, "cpu")["labels"]) for rows in all_rows).to(device)
        batch["num_items_in_batch"] = n_items
        with dtcp_hf.context_parallel(model, mesh, batch, mesh_dim="cp", layout=layout) as cp:
            out = model(**cp.inputs)
            out.loss.backward()        # inside the block
        opt.step()
        opt.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)           # the shares of every rank: the global loss
        line = f"step {step:3d}  loss {loss.item():.6f}  {time.perf_counter() - t0:.2f}s"
        if reference is not None:
            ref_loss = 0.0
            for rows in all_rows:       # the same global batch, without CP or FSDP, in this process
                b = packed_batch(rows, device)
                o = reference(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
                part = torch.nn.functional.cross_entropy(
                    o.logits[:, :-1].flatten(0, 1).float(), b["labels"][:, 1:].flatten(), ignore_index=-100,
                    reduction="sum") / n_items
                part.backward()
                ref_loss += part.detach()
            ref_opt.step()
            ref_opt.zero_grad()
            rel = abs(loss.item() - float(ref_loss)) / abs(float(ref_loss))
            worst = max(worst, rel)
            line += f"  | no CP {float(ref_loss):.6f}  rel diff {rel:.2e}"
        if rank == 0:
            print(line, flush=True)
    if args.check:
        # transformers computes its loss in float32 (it casts the logits), whatever the model's dtype
        # (bf16: 1e-3, as examples/train_llama.py; measured 1.8e-6 to 6.0e-6 on 2 H100s and 2 H200s)
        tol = {torch.float64: 1e-6, torch.float32: 1e-4}.get(dtype, 1e-3)
        if rank == 0:
            print(f"check: worst relative loss difference {worst:.2e} (tolerance {tol:g} for {dtype})", flush=True)
        if worst > tol:
            raise SystemExit(f"check failed: {worst:.2e} > {tol:g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
