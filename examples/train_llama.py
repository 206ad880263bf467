"""Train a small Llama-style decoder with context parallelism: `torch.compile` + `dtcp.context_parallel`.

The model below is written plainly and calls `F.scaled_dot_product_attention` like any
single-device model; `dtcp.context_parallel` shards the batch along the sequence and turns
every SDPA call into exact ring attention. Rotary embeddings get the global position of each
local token from `cp.positions(seq_len)` (= `layout.positions(seq_len, group)`).

    torchrun --nproc-per-node 2 examples/train_llama.py --check              # CPU (gloo), fp32
    torchrun --nproc-per-node 2 examples/train_llama.py --check --dtype bf16 # GPUs (NCCL)
    torchrun --nproc-per-node 4 examples/train_llama.py --dp 2 --fsdp        # 2-D (dp, cp) mesh, FSDP2 over dp

With --check, rank 0 afterwards runs the same steps on the full sequences without context
parallelism (one process, same compile backend) and asserts that every step's loss agrees
(relative 1e-6 in fp32, 1e-3 in bf16).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# Run from a checkout without installing: torchrun puts examples/ on sys.path, not the repo root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dtcp  # noqa: E402


# ---- the model ---------------------------------------------------------------------------------


@dataclass
class Config:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, positions, theta: float):
    """Rotate pairs of x (B, H, S, Dh) by angles positions (S,) * theta^(-2i/Dh).
    `positions` are global token positions, so each shard rotates as in the full sequence."""
    dh = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (S, Dh/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, positions):  # x: (B, S, dim); positions: (S,)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):  # SwiGLU
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.dim), FeedForward(cfg)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, positions):  # tokens: (B, S) int64; positions: (S,) -> logits (B, S, vocab)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x))


# ---- training ----------------------------------------------------------------------------------


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, device):
    """(batch, seq + 1) tokens, the same on every rank: noisy arithmetic progressions, so the loss falls."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, (batch, seq + 1), generator=g), tokens)
    return tokens.to(device)


def build(cfg: Config, device, compile_backend: str):
    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    for layer in model.layers:  # per-block compile: what FSDP2 and activation checkpointing expect
        if compile_backend != "none":
            layer.compile(backend=compile_backend, fullgraph=True)
    return model


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)


def autocast(device, dtype):
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def train_cp(args, cfg, device, dtype):
    """The context-parallel run over a (dp, cp) mesh. Returns the global loss of every step."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} must divide the number of ranks ({world})")
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "cp"))
    cp_group, dp_rank = mesh["cp"].get_group(), mesh.get_local_rank("dp")
    layout = dtcp.layout_from_spec(args.layout)
    model = build(cfg, device, args.compile)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = optimizer(model)  # after fully_shard, which replaces the parameters

    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = synthetic_batch(step, args.batch * args.dp, args.seq, cfg.vocab, device)
        tokens = tokens.chunk(args.dp)[dp_rank]  # this dp rank's sequences
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with dtcp.context_parallel(mesh, buffers=[inputs, labels], buffer_seq_dims=[1, 1],
                                   no_restore_buffers={inputs, labels}, mesh_dim="cp", layout=layout) as cp:
            with autocast(device, dtype):
                logits = model(inputs, cp.positions(args.seq).to(device))  # (B, S/cp, vocab)
            # Every rank holds as many tokens, so the mean of the local means is the global mean,
            # and averaging gradients over all ranks gives the gradient of the global mean.
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        for p in model.parameters():  # cp ranks hold the same parameters: average their grads
            g = p.grad.to_local() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
            if not args.fsdp and args.dp > 1:
                dist.all_reduce(g)  # also over dp (FSDP2 does that itself)
                g.div_(world)
            else:
                dist.all_reduce(g, group=cp_group)
                g.div_(world // args.dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = (global_loss / world).item()
        dt = time.perf_counter() - t0
        losses.append(global_loss)
        if dist.get_rank() == 0:
            tok_s = args.batch * args.dp * args.seq / dt
            note = "  (includes compile)" if step == 0 and args.compile != "none" else ""
            print(f"step {step + 1}/{args.steps}  loss {global_loss:.6f}  {tok_s:,.0f} tokens/s  ({dt * 1e3:.0f} ms){note}",
                  flush=True)
    return losses


def train_reference(args, cfg, device, dtype):
    """The same steps on full sequences in this one process, without context parallelism."""
    model = build(cfg, device, args.compile)
    opt = optimizer(model)
    positions = torch.arange(args.seq, device=device)
    losses = []
    for step in range(args.steps):
        tokens = synthetic_batch(step, args.batch * args.dp, args.seq, cfg.vocab, device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with autocast(device, dtype):
            logits = model(inputs, positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (whole, before sharding)")
    p.add_argument("--batch", type=int, default=2, help="sequences per dp rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dp", type=int, default=1, help="data-parallel size; cp = ranks / dp")
    p.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 over the dp mesh dim")
    p.add_argument("--layout", default="zigzag", help="contiguous | zigzag | striped[:block]")
    p.add_argument("--compile", default="inductor", help="torch.compile backend, or 'none'")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--check", action="store_true", help="compare every step's loss with a run without CP")
    args = p.parse_args()

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = Config(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, ffn_dim=2 * args.dim)
    if dist.get_rank() == 0:
        cp = dist.get_world_size() // args.dp
        print(f"{dist.get_world_size()} ranks on {device.type} ({backend}): dp={args.dp} cp={cp} layout={args.layout} "
              f"dtype={dtype} compile={args.compile} fsdp={args.fsdp}; seq={args.seq} ({args.seq // cp} per rank)", flush=True)

    losses = train_cp(args, cfg, device, dtype)

    ok = torch.ones(1, device=device)
    if args.check and dist.get_rank() == 0:
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        ref = train_reference(args, cfg, device, dtype)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        print("reference (no CP, one process): " + " ".join(f"{x:.6f}" for x in ref))
        print(f"check: max relative loss difference {worst:.2e} (tolerance {tol:.0e}) -> {'PASS' if worst <= tol else 'FAIL'}", flush=True)
        ok.fill_(float(worst <= tol))
    dist.broadcast(ok, src=0)  # every rank exits with the verdict
    dist.destroy_process_group()
    if not ok.item():
        sys.exit(1)


if __name__ == "__main__":
    main()
