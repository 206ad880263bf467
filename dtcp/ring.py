"""The ring itself: forward and backward loops over a `RingPlan`, on plain tensors.

Forward: Q stays; K/V blocks travel one rank per step. The next block's transfer is issued
before the current block's kernels so communication overlaps compute (NCCL runs on its own
stream; gloo in its own threads). Partial results merge into float32 (out, lse) accumulators.

Backward: dQ accumulates locally. Each block's dK/dV accumulator (float32) travels with the
block one step behind its K/V: a rank adds its share after computing and passes it on. After the
last step the accumulators are sent home, so each rank ends with the gradients of its own K/V.

Buffers: the caller's K/V are sent as they are and never written; two spare K/V buffers
alternate, and two float32 dK/dV buffers alternate (one being added to and sent, one receiving),
all allocated once per call.

`comm=NoComm()` runs the same kernels and merges with no communication, each step reusing the
rank's own K/V: the benchmarks' "ideal" (see benchmarks/bench_attention.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from .comm import STATS, RingComm, nbytes
from .kernels import Kernel, acc_dtype
from .merge import merge_into_
from .schedule import RingPlan


class NoComm:
    """Stand-in for RingComm that moves nothing: buffers stay as they are."""

    @staticmethod
    def spare_buffers(like, kind):
        return [[torch.empty_like(t) for t in like] for _ in range(2)]

    def exchange(self, send, recv, shift: int = 1):
        return None

    @staticmethod
    def wait(works) -> None:
        pass


def _rows(t0: int, t1: int):
    return (slice(None), slice(None), slice(t0, t1))


def _covers_all_rows(step, local_len: int) -> bool:
    return len(step.tasks) == 1 and step.tasks[0].q_start == 0 and step.tasks[0].q_end == local_len


def ring_forward(q, k, v, pg, plan: RingPlan, kernel: Kernel, scale: float, comm: Optional[object] = None):
    """q: (B, Hq, L, D), k/v: (B, Hkv, L, D), this rank's shards.
    Returns out (B, Hq, L, D) in q.dtype and lse (B, Hq, L) float32 (float64 for float64)."""
    comm = RingComm(pg, q.device) if comm is None else comm
    acc = acc_dtype(q.dtype)
    cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(list(cur), "kv") if plan.num_rounds else []
    out_acc = lse_acc = None

    for t, step in enumerate(plan.steps):
        works = None
        if t < plan.num_rounds:
            works = comm.exchange(list(cur), list(spare[t % 2]))
            if works is not None:
                STATS.kv_rounds += 1
                STATS.kv_bytes_sent += nbytes(cur)
        for task in step.tasks:
            qs, ks = _rows(task.q_start, task.q_end), _rows(task.k_start, task.k_end)
            o, l = kernel.forward(q[qs], cur[0][ks], cur[1][ks], task.lo, task.hi, scale)
            if out_acc is None and _covers_all_rows(step, q.shape[2]):
                # First result covering every row: it *is* the running result (no merge needed).
                # Contiguous, as the op's fake promises.
                # (Tensor.to returns self when the dtype already matches, whatever the strides.)
                out_acc = torch.empty(q.shape, dtype=acc, device=q.device).copy_(o)
                lse_acc = l.to(acc).contiguous()
                continue
            if out_acc is None:
                out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)
        if works is not None:
            comm.wait(works)
            cur = spare[t % 2]
    if out_acc is None:  # no task at all (cannot happen with the built-in layouts)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    return out_acc.to(q.dtype), lse_acc


def ring_backward(dout, q, k, v, out, lse, pg, plan: RingPlan, kernel: Kernel, scale: float,
                  comm: Optional[object] = None):
    """Gradients of ring_forward. Returns dq, dk, dv in the input dtypes."""
    comm = RingComm(pg, q.device) if comm is None else comm
    acc = acc_dtype(q.dtype)
    rounds = plan.num_rounds
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(list(cur), "kv") if rounds else []
    # Two dK/dV buffers: grads[t % 2] is added to and sent at step t; the other receives.
    like = [torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device)]
    grads = comm.spare_buffers(like, "grad") if rounds else [like]
    del like
    for g in grads[0]:
        g.zero_()
    grad_cur, grad_works = grads[0], None

    for t, step in enumerate(plan.steps):
        kv_works = None
        if t < rounds:
            kv_works = comm.exchange(list(cur), list(spare[t % 2]))
            if kv_works is not None:
                STATS.kv_rounds += 1
                STATS.kv_bytes_sent += nbytes(cur)
        elif t % 2 < len(spare):
            spare[t % 2] = None  # nothing more to receive: let the kernels reuse that memory
        shares = []
        for task in step.tasks:
            qs, ks = _rows(task.q_start, task.q_end), _rows(task.k_start, task.k_end)
            dq_t, dk_t, dv_t = kernel.backward(
                dout[qs], q[qs], cur[0][ks], cur[1][ks], out[qs], lse[qs], task.lo, task.hi, scale
            )
            dq[qs] += dq_t
            shares.append((ks, dk_t, dv_t))
            del dq_t, dk_t, dv_t
        if grad_works is not None:
            comm.wait(grad_works)  # this block's travelling dK/dV has arrived in grad_cur
            grad_works = None
        for ks, dk_t, dv_t in shares:
            grad_cur[0][ks] += dk_t
            grad_cur[1][ks] += dv_t
        del shares
        if t < rounds:
            grad_nxt = grads[(t + 1) % 2]
            grad_works = comm.exchange(list(grad_cur), list(grad_nxt))
            if grad_works is not None:
                STATS.grad_rounds += 1
                STATS.grad_bytes_sent += nbytes(grad_cur)
                grad_cur = grad_nxt
            if kv_works is not None:
                comm.wait(kv_works)
                cur = spare[t % 2]

    dq = dq.to(q.dtype)
    if not rounds or isinstance(comm, NoComm):
        return dq, grad_cur[0].to(k.dtype), grad_cur[1].to(v.dtype)
    # grad_cur is finished and belongs to the source of the last step, `rounds` ranks behind:
    # send it home in the output dtype (the result is rounded to it anyway), straight into the
    # returned tensors.
    send = (grad_cur[0].to(k.dtype), grad_cur[1].to(v.dtype))
    del grads, grad_cur, spare, cur
    home = (torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format))
    comm.wait(comm.exchange(list(send), list(home), shift=-rounds))
    STATS.grad_rounds += 1
    STATS.grad_bytes_sent += nbytes(send)
    return dq, home[0], home[1]
