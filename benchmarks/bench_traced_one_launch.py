"""The compiled all-gather route: one varlen flash launch per layer against one launch per task.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_traced_one_launch.py

torch.compile (inductor, fullgraph) of a causal zigzag `dtcp.ring_attention` call with
kv_exchange="allgather", bf16, q/k/v as transposed views of (B, S, H, D) projections (as models
hand them to attention). For each shape:
  * errors of out, dq, dk, dv against a float64 reference, as a ratio to the flash kernel's own
    errors on the unsharded sequence (brief: at most 1.5), for the one-launch route and the
    per-task route it replaces;
  * which attention ops the compiled graphs hold (aot_autograd graphs, counted);
  * forward+backward wall time per call (host-bound at these sizes), both routes and eager.
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import dtcp

from _setup import init_distributed

dev = init_distributed("cuda")
rank = dist.get_rank()
layout = dtcp.Zigzag()


def attn(q, k, v):
    return dtcp.ring_attention(q, k, v, layout=layout, is_causal=True, enable_gqa=True, strategy="allgather")


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def inputs(B, HQ, HKV, S, D):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dev).transpose(1, 2) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(B, HQ, S, D, generator=g).to(dev)


def reference(q, k, v, do):
    HQ, HKV, S = q.shape[1], k.shape[1], q.shape[2]
    qq, kk, vv = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = HQ // HKV
    s = (qq @ kk.repeat_interleave(rep, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ vv.repeat_interleave(rep, 1)
    o.backward(do.double())
    return [o.detach(), qq.grad, kk.grad, vv.grad]


def own_errors(q, k, v, do, ref):
    """The flash kernel's own errors: bf16 SDPA (flash backend) on the whole sequence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.bfloat16().detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    o.backward(do.bfloat16())
    return [rel(x, y) for x, y in zip([o] + [t.grad for t in leaves], ref)]


def sharded_leaves(q, k, v):
    # keep the transposed-view layout after sharding (shard the (B, S, H, D) memory)
    return [layout.shard(t.transpose(1, 2), dim=1).transpose(1, 2).bfloat16().detach().requires_grad_()
            for t in (q, k, v)]


def run(fn, q, k, v, do):
    leaves = sharded_leaves(q, k, v)
    o = fn(*leaves)
    o.backward(layout.shard(do, dim=2).bfloat16())
    return [o.detach()] + [t.grad for t in leaves]


def graph_ops(q, k, v, do):
    graphs = []

    def keep(gm, ex):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    run(torch.compile(attn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True), q, k, v, do)
    text = "\n".join(graphs)
    return {name: text.count(f"aten.{name}.default]") for name in (
        "_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward")}


def bench(fn, q, k, v, do, n=50):
    leaves = sharded_leaves(q, k, v)
    dd = layout.shard(do, dim=2).bfloat16()
    for _ in range(5):
        fn(*leaves).backward(dd)
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        fn(*leaves).backward(dd)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


SHAPES = [  # (B, HQ, HKV, S, D): torchtitan's llama3 debug model; GQA; a longer sequence
    (8, 16, 16, 2048, 16),
    (2, 8, 2, 4096, 64),
    (1, 32, 8, 8192, 128),
]
for shape in SHAPES:
    q, k, v, do = inputs(*shape)
    full = reference(q, k, v, do)
    ref = [layout.shard(t, dim=2) for t in full]
    own = own_errors(q, k, v, do, full)
    line = f"rank {rank} B{shape[0]} H{shape[1]}/{shape[2]} S{shape[3]} D{shape[4]}:"
    times = {}
    for route, one_launch in (("one-launch", True), ("per-task", False)):
        dtcp.config.one_launch = one_launch  # part of the op's arguments: compile caches tell them apart
        ops = graph_ops(q, k, v, do)
        torch._dynamo.reset()
        comp = torch.compile(attn, fullgraph=True)
        got = run(comp, q, k, v, do)
        errs = [rel(g, r) for g, r in zip(got, ref)]
        ratio = max(e / o for e, o in zip(errs, own))
        times[route] = bench(comp, q, k, v, do)
        line += (f"\n  {route:10s} err out/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errs)
                 + f"  max ratio to kernel's own {ratio:.3f}  graph ops {ops}")
    dtcp.config.one_launch = True
    times["eager"] = bench(attn, q, k, v, do)
    line += ("\n  kernel's own err " + " ".join(f"{e:.2e}" for e in own)
             + "\n  fwd+bwd ms: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items())
             + f"  (per-task / one-launch = {times['per-task'] / times['one-launch']:.3f})")
    print(line, flush=True)
dist.barrier()  # no rank tears gloo down while a peer still talks to it
dist.destroy_process_group()
