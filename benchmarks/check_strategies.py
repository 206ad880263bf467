"""Correctness of every strategy on GPUs, in bf16, against a float64 reference: each case's error
(out, dq, dk, dv) on this rank's rows must stay within 1.5x the error of the same kernel running the
whole sequence on one GPU (measured on the same rows).

    torchrun --nproc-per-node 2 benchmarks/check_strategies.py

Strategies: ring, allgather, ulysses, and hybrid on the 2-D meshes 2 GPUs allow (1x2: Ulysses over
both; 2x1: the ring across two groups of one), and on 4 or more GPUs (N/2)x2 (the ring across N/2
groups, Ulysses over the 2 GPUs in each). Masks: causal (zigzag), window (S/4, 0) on the
contiguous layout, documents (zigzag), softcap + sinks, at S = 4096; heads 32/8 (GQA) and 8/1 (one K/V
head: Ulysses replicates it over its ranks).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtcp  # noqa: E402
from dtcp._groups import cp_size_and_rank  # noqa: E402
from _setup import init_distributed  # noqa: E402


def reference(q, k, v, dout, mask, scale, softcap=None, sinks=None):
    """float64 attention and gradients (q, k, v full sequences, (1, H, S, D))."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(1, -1, s.shape[2], 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    out = p @ vv
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def mask_of(s, window, cu, device):
    i = torch.arange(s, device=device)
    m = i[None, :] <= i[:, None]
    if window is not None:
        m &= i[None, :] >= i[:, None] - window
    if cu is not None:
        doc = torch.bucketize(i, torch.tensor(cu[1:], device=device), right=True)
        m &= doc[None, :] == doc[:, None]
    return m


def err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def run_case(name, strategy, group, one, layout, hq, hkv, s, device, window=None, cu=None, softcap=None,
             with_sinks=False):
    """`one`: this rank's group of one (the whole sequence on this GPU: the kernel's own error)."""
    n, cp_rank = cp_size_and_rank(group)
    g = torch.Generator(device=device).manual_seed(1)
    d = 128
    q = torch.randn(1, hq, s, d, device=device, generator=g).bfloat16()
    k = torch.randn(1, hkv, s, d, device=device, generator=g).bfloat16()
    v = torch.randn(1, hkv, s, d, device=device, generator=g).bfloat16()
    dout = torch.randn(1, hq, s, d, device=device, generator=g).bfloat16()
    sinks = torch.randn(hq, device=device, generator=g) if with_sinks else None
    scale = d ** -0.5
    ref = reference(q, k, v, dout, mask_of(s, window, cu, device), scale, softcap, sinks)
    kw = dict(is_causal=True, enable_gqa=hq != hkv, window_size=None if window is None else (window, 0),
              softcap=softcap)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    # the kernel's own error: the whole sequence on this GPU (a group of one), the same kernel choice
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_one = None if sinks is None else sinks.clone().requires_grad_()
    out1 = dtcp.ring_attention(*full, one, layout=dtcp.Contiguous(), cu_seqlens=cu_t, sinks=sink_one, **kw)
    out1.backward(dout)
    pos = layout.global_positions(s, n, cp_rank).to(device)
    own = [out1.detach()] + [t.grad for t in full]
    # the strategy
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    sink_cp = None if sinks is None else sinks.clone().requires_grad_()
    out = dtcp.ring_attention(*local, group, layout=layout, cu_seqlens=cu_t, sinks=sink_cp, strategy=strategy, **kw)
    out.backward(dout[:, :, pos])
    got = [out.detach()] + [t.grad for t in local]
    worst = 0.0
    cells = []
    for key, a, b, r in zip(("out", "dq", "dk", "dv"), got, own, ref):
        # dk/dv of a rank's rows are partial sums over queries everywhere: compare on the rank's rows
        e_cp, e_one = err(a, r[:, :, pos]), err(b[:, :, pos], r[:, :, pos])
        worst = max(worst, e_cp / e_one)
        cells.append(f"{key} {e_cp:.2e}/{e_one:.2e}")
    t = torch.tensor([worst], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ok = t.item() <= 1.5
    if dist.get_rank() == 0:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<34} {strategy:<9} worst ratio {t.item():.3f}  " + "  ".join(cells),
              flush=True)
    return ok


def main():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script (gloo)")
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args()
    device = init_distributed(args.device)
    n = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh_1x2 = init_device_mesh(device.type, (1, n), mesh_dim_names=("ring", "ulysses"))
    mesh_2x1 = init_device_mesh(device.type, (n, 1), mesh_dim_names=("ring", "ulysses"))
    meshes = [mesh_1x2, mesh_2x1]
    if n >= 4 and n % 2 == 0:  # both dimensions real: n/2 ring groups, 2 ranks exchanging heads in each
        meshes.append(init_device_mesh(device.type, (n // 2, 2), mesh_dim_names=("ring", "ulysses")))
    s = args.seq  # the float64 reference holds a few (32, S, S) tensors
    docs = [0, s * 3 // 40, s // 4, s * 11 // 40, s * 5 // 8, s]
    ones = [dist.new_group([r]) for r in range(n)]  # every rank creates every group, in order
    one = ones[dist.get_rank()]
    cases = []
    for strategy, group in [("ring", None), ("allgather", None), ("ulysses", None)] + [("hybrid", m) for m in meshes]:
        tag = "" if group is None else f" {tuple(group.shape)}"
        cases += [
            (f"causal zigzag 32/8{tag}", strategy, group, dtcp.Zigzag(), 32, 8, {}),
            (f"causal zigzag 8/1{tag}", strategy, group, dtcp.Zigzag(), 8, 1, {}),
            (f"window S/4 contiguous 32/8{tag}", strategy, group, dtcp.Contiguous(), 32, 8, {"window": s // 4}),
            (f"documents zigzag 32/8{tag}", strategy, group, dtcp.Zigzag(), 32, 8, {"cu": docs}),
            (f"softcap+sinks zigzag 32/8{tag}", strategy, group, dtcp.Zigzag(), 32, 8,
             {"softcap": 30.0, "with_sinks": True}),
        ]
    failures = 0
    for name, strategy, group, layout, hq, hkv, extra in cases:
        try:
            failures += not run_case(name, strategy, group, one, layout, hq, hkv, s, device, **extra)
        except Exception as e:  # noqa: BLE001
            failures += 1
            if dist.get_rank() == 0:
                print(f"ERR  {name:<34} {strategy:<9} {type(e).__name__}: {str(e)[:300]}", flush=True)
    if dist.get_rank() == 0:
        print(f"\n{len(cases) - failures} passed, {failures} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
