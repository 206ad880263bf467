"""The ring itself: forward and backward loops over a `RingPlan`, on plain tensors.

Forward: Q stays; K/V blocks travel one rank per step. The next block's transfer is issued
before the current block's kernels so communication overlaps compute (NCCL runs on its own
stream; gloo in its own threads). Partial results merge into float32 (out, lse) accumulators.

Backward: dQ accumulates locally. Each block's dK/dV accumulator (float32) travels with the
block one step behind its K/V: a rank adds its share after computing and passes it on. After the
last step the accumulators are sent home, so each rank ends with the gradients of its own K/V.

Buffers: the caller's K/V are sent as they are and never written; two spare K/V buffers and two
spare dK/dV buffers alternate, allocated once per call.
"""

from __future__ import annotations

import torch

from .comm import STATS, RingComm, nbytes
from .kernels import Kernel, acc_dtype
from .merge import merge_into_
from .schedule import RingPlan


def _rows(t0: int, t1: int):
    return (slice(None), slice(None), slice(t0, t1))


def ring_forward(q, k, v, pg, plan: RingPlan, kernel: Kernel, scale: float):
    """q: (B, Hq, L, D), k/v: (B, Hkv, L, D), this rank's shards.
    Returns out (B, Hq, L, D) in q.dtype and lse (B, Hq, L) float32 (float64 for float64)."""
    comm = RingComm(pg)
    acc = acc_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    cur = (k.contiguous(), v.contiguous())
    spare = [(torch.empty_like(cur[0]), torch.empty_like(cur[1])) for _ in range(min(2, plan.num_rounds))]

    for t, step in enumerate(plan.steps):
        works, nxt = None, None
        if t < plan.num_rounds:
            nxt = spare[t % 2]
            works = comm.exchange(list(cur), list(nxt))
            STATS.kv_rounds += 1
            STATS.kv_bytes_sent += nbytes(cur)
        for task in step.tasks:
            qs, ks = _rows(task.q_start, task.q_end), _rows(task.k_start, task.k_end)
            o, l = kernel.forward(q[qs], cur[0][ks], cur[1][ks], task.lo, task.hi, scale)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)
        if works is not None:
            comm.wait(works)
            cur = nxt
    return out_acc.to(q.dtype), lse_acc


def ring_backward(dout, q, k, v, out, lse, pg, plan: RingPlan, kernel: Kernel, scale: float):
    """Gradients of ring_forward. Returns dq, dk, dv in the input dtypes."""
    comm = RingComm(pg)
    acc = acc_dtype(q.dtype)
    rounds = plan.num_rounds
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur = (k.contiguous(), v.contiguous())
    spare = [(torch.empty_like(cur[0]), torch.empty_like(cur[1])) for _ in range(min(2, rounds))]
    grad_cur = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
    grad_spare = [(torch.empty_like(grad_cur[0]), torch.empty_like(grad_cur[1])) for _ in range(2 if rounds else 0)]
    grad_works = None

    for t, step in enumerate(plan.steps):
        kv_works, nxt = None, None
        if t < rounds:
            nxt = spare[t % 2]
            kv_works = comm.exchange(list(cur), list(nxt))
            STATS.kv_rounds += 1
            STATS.kv_bytes_sent += nbytes(cur)
        shares = []
        for task in step.tasks:
            qs, ks = _rows(task.q_start, task.q_end), _rows(task.k_start, task.k_end)
            dq_t, dk_t, dv_t = kernel.backward(
                dout[qs], q[qs], cur[0][ks], cur[1][ks], out[qs], lse[qs], task.lo, task.hi, scale
            )
            dq[qs] += dq_t
            shares.append((ks, dk_t, dv_t))
        if grad_works is not None:
            comm.wait(grad_works)  # this block's travelling dK/dV has arrived in grad_cur
        for ks, dk_t, dv_t in shares:
            grad_cur[0][ks] += dk_t
            grad_cur[1][ks] += dv_t
        if t < rounds:
            grad_nxt = grad_spare[t % 2]
            grad_works = comm.exchange(list(grad_cur), list(grad_nxt))
            STATS.grad_rounds += 1
            STATS.grad_bytes_sent += nbytes(grad_cur)
            comm.wait(kv_works)
            cur, grad_cur = nxt, grad_nxt

    if rounds:
        # grad_cur belongs to the source of the last step, `rounds` ranks behind: send it home.
        # The other spare is free: its last send was waited on in the last step.
        home = grad_spare[rounds % 2]
        comm.wait(comm.exchange(list(grad_cur), list(home), shift=-rounds))
        STATS.grad_rounds += 1
        STATS.grad_bytes_sent += nbytes(grad_cur)
        grad_cur = home
    return dq.to(q.dtype), grad_cur[0].to(k.dtype), grad_cur[1].to(v.dtype)
