"""N ranks of the ring in one process (dtcp.comm.simulated): each rank's real plan, kernel calls
and received blocks, on one device. Shared by the CPU check of the harness and the one-GPU
exactness test (tests/gpu/test_one_gpu_ranks.py)."""

from __future__ import annotations

import torch

from dtcp.comm.simulated import SimulatedRing, locked
from dtcp.exec.ring import ring_backward, ring_forward
from dtcp.plan import AttnMask, ring_plans


def segments_of(docs):
    out, pos = [], 0
    for n in docs:
        out.append((pos, pos + n))
        pos += n
    return tuple(out)


def simulated_ring(layout, n, q, k, v, dout, kernel, *, is_causal=True, window=(-1, -1), docs=None, scale=None):
    """Full tensors q, k, v, dout (1, H, S, D) -> (out, lse, dq, dk, dv) in global token order,
    computed by N simulated ranks of the ring (each rank's shards, plan and kernel calls)."""
    s = q.shape[2]
    local_len = s // n
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    mask = AttnMask.make(is_causal, window, None if docs is None else segments_of(docs))
    plans = ring_plans(layout, local_len, n, is_causal, mask)
    shard = lambda t, r: t.index_select(2, layout.global_positions(s, n, r).to(t.device)).contiguous()  # noqa: E731
    kern = locked(kernel)

    def rank_fn(r, comm):
        qr, kr, vr, dr = (shard(t, r) for t in (q, k, v, dout))
        out, lse = ring_forward(qr, kr, vr, plans[r], kern, scale, comm)
        dq, dk, dv = ring_backward(dr, qr, kr, vr, out, lse, plans[r], kern, scale, comm)
        return out, lse, dq, dk, dv

    results = SimulatedRing(n).run(rank_fn)
    perm = layout.permutation(s, n).to(q.device)
    merged = []
    for i in range(5):
        cat = torch.cat([res[i] for res in results], dim=2)
        full = torch.empty_like(cat)
        full[:, :, perm] = cat
        merged.append(full)
    return tuple(merged)
