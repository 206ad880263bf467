"""Batches whose rows have their own documents (torchtitan's packed batches), on N GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_docs_batch.py

For each shape: random documents per row (0-15 cuts), causal, zigzag, bf16. dtcp's call with the
boundaries over the flattened batch (which under kv_exchange="auto" at these sizes is the
all-gather schedule with one varlen flash launch for every document of every row) against a
float64 reference; the same kernel's own error over the unsharded packed batch; and the
forward+backward time of that call against one call per batch row (the former torchtitan
integration). Prints the plan type and kernel taken.
"""
import time, torch, torch.distributed as dist
import dtcp
from dtcp.exec.route import CallArgs, route_for
from dtcp.kernels import KERNELS, VarlenSeqs, default_scale
dist.init_process_group("nccl"); r = dist.get_rank(); n = dist.get_world_size(); torch.cuda.set_device(r)
dev = torch.device("cuda", r)
layout = dtcp.Zigzag()

def docs_for(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        cuts = sorted(set(torch.randint(1, S, (int(torch.randint(0, 16, (1,), generator=g)),), generator=g).tolist()))
        rows.append([0] + cuts + [S])
    return rows

def check(B, HQ, HKV, S, D):
    rows = docs_for(B, S, 3)
    flat = sorted({b * S + c for b, cu in enumerate(rows) for c in cu})
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, h, S, D, generator=g).to(dev) for h in (HQ, HKV, HKV, HQ))
    # float64 reference, each row with its own documents
    keep = torch.zeros(B, 1, S, S, dtype=torch.bool, device=dev)
    i = torch.arange(S, device=dev)
    for b, cu in enumerate(rows):
        doc = torch.zeros(S, dtype=torch.long, device=dev)
        for a, e in zip(cu[:-1], cu[1:]):
            doc[a:e] = a
        keep[b, 0] = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    s = (qq @ kk.repeat_interleave(HQ // HKV, 1).transpose(-1, -2)) * D ** -0.5
    o = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vv.repeat_interleave(HQ // HKV, 1)
    o.backward(do.double())
    ref = [o.detach(), qq.grad, kk.grad, vv.grad]
    del s, keep
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    # the kernel's own error: flash varlen over the unsharded packed batch
    cu = torch.tensor(flat, dtype=torch.int32, device=dev)
    lens = [b - a for a, b in zip(flat[:-1], flat[1:])]
    seqs = VarlenSeqs(tuple(flat), tuple(flat), cu, cu, max(lens), max(lens))
    pk = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], D).bfloat16()
    unpk = lambda t: t.view(B, S, -1, D).transpose(1, 2)
    fl = KERNELS["flash"]
    ko, kl = fl.varlen_forward(pk(q), pk(k), pk(v), seqs, (-1, 0), D ** -0.5)
    kdq, kdk, kdv = fl.varlen_backward(pk(do), pk(q), pk(k), pk(v), ko, kl, seqs, (-1, 0), D ** -0.5)
    own = [rel(unpk(x), y) for x, y in zip((ko, kdq, kdk, kdv), ref)]
    # dtcp, CP over both GPUs
    cu_t = torch.tensor(flat, dtype=torch.int32, device=dev)
    def attn(leaves, per_row_calls=False):
        if per_row_calls:  # the integration's former loop: one call per row
            outs = [dtcp.ring_attention(*(t[b:b + 1] for t in leaves), layout=layout, is_causal=True,
                                        enable_gqa=HQ != HKV, cu_seqlens=torch.tensor(cu_r, dtype=torch.int32, device=dev))
                    for b, cu_r in enumerate(rows)]
            return torch.cat(outs)
        return dtcp.ring_attention(*leaves, layout=layout, is_causal=True, enable_gqa=HQ != HKV, cu_seqlens=cu_t)
    leaves = [layout.shard(t, dim=2).bfloat16().detach().requires_grad_() for t in (q, k, v)]
    out = attn(leaves); out.backward(layout.shard(do, dim=2).bfloat16())
    got = [out.detach()] + [t.grad for t in leaves]
    errs = [rel(x, layout.shard(y, dim=2)) for x, y in zip(got, ref)]
    call = CallArgs(dist.group.WORLD.group_name, layout.spec(), True, default_scale(D), "auto", -1, -1, "auto")
    route = route_for(*leaves, call, tuple(cu_t.tolist()), "benchmark")
    plan, kernel = route.plan, route.kernel
    print(f"rank {r} B{B} H{HQ}/{HKV} S{S} D{D} docs/row {[len(c) - 1 for c in rows]} plan {type(plan).__name__} "
          f"kernel {kernel.name}", flush=True)
    for name, e, ow in zip(("out", "dq", "dk", "dv"), errs, own):
        print(f"rank {r}   {name}: dtcp {e:.3e}  kernel own {ow:.3e}  ratio {e / ow:.3f}", flush=True)
    def bench(per_row_calls, it=10):
        dd = layout.shard(do, dim=2).bfloat16()
        for _ in range(3): attn(leaves, per_row_calls).backward(dd)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(it): attn(leaves, per_row_calls).backward(dd)
        torch.cuda.synchronize(); return (time.perf_counter() - t) / it * 1e3
    print(f"rank {r}   fwd+bwd ms: one varlen call {bench(False):.2f}  one call per row {bench(True, 3):.2f}", flush=True)

check(8, 16, 16, 2048, 16)   # torchtitan debug model
check(2, 8, 2, 4096, 64)     # GQA, D=64
dist.barrier()  # no rank tears gloo down while a peer still talks to it
dist.destroy_process_group()
