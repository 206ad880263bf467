"""The ring itself: forward and backward loops over a `RingPlan`, on plain tensors.

Forward: Q stays; K/V blocks travel one rank per step. The next block's transfer is issued
before the current block's kernels so communication overlaps compute. Partial results merge into
float32 (out, lse) accumulators (float64 for float64 inputs).

Plans may have fewer steps than ranks (sliding windows, documents) and up to two chains: blocks
travel forward (shift +1) and then backward (shift -1); the first step of a chain receives the
sender's own K/V (see dtcp/plan/ring.py). Each chain sends only the blocks it uses.

Backward: dQ accumulates locally, and so does the share of a rank's own block. For the other
blocks a dK/dV accumulator (float32) starts at the first holder of a chain and travels with the
block one step behind its K/V: a rank adds its share after computing and passes it on. At the end
of a chain the accumulator is sent home, so each rank ends with the gradients of its own K/V. The
backward sends exactly as many dK/dV blocks as K/V blocks.

Buffers: the caller's K/V are sent as they are and never written; two spare K/V buffers and two
dK/dV buffers alternate (copy-engine slots reused across calls, else allocated once per call).
`comm=NoComm()` runs the same kernels and merges with no communication (the benchmarks' ideal).
"""

from __future__ import annotations

import torch

from ..comm.p2p import NoComm
from ..kernels import Kernel, acc_dtype
from ..kernels.base import seq_slice
from ..plan import RingPlan
from .merge import apply_sink_, merge_into_


def _covers_all_rows(step, local_len: int) -> bool:
    return len(step.tasks) == 1 and step.tasks[0].q_start == 0 and step.tasks[0].q_end == local_len


def ring_forward(q, k, v, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, sink=None):
    """q: (B, Hq, L, D), k: (B, Hkv, L, D), v: (B, Hkv, L, Dv), this rank's shards; sink: (Hq,) or
    None, added once per row after the merge. Returns out (B, Hq, L, Dv) in q.dtype and lse
    (B, Hq, L) float32 (float64 for float64)."""
    acc = acc_dtype(q.dtype)
    out_shape = q.shape[:-1] + v.shape[-1:]
    local = cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(list(cur), "kv") if plan.num_rounds else []
    out_acc = lse_acc = None

    for t, step in enumerate(plan.steps):
        works = None
        if t < plan.num_rounds:
            works = _send_next_block(comm, plan, t, cur, local, spare[t % 2])
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), seq_slice(task.k_start, task.k_end)
            o, l = kernel.forward(q[qs], cur[0][ks], cur[1][ks], task.lo, task.hi, scale, softcap=softcap)
            if out_acc is None and _covers_all_rows(step, q.shape[2]):
                # First result covering every row: it *is* the running result (no merge needed).
                # Contiguous, as the op's fake promises (Tensor.to returns self when the dtype
                # already matches, whatever the strides).
                out_acc = torch.empty(out_shape, dtype=acc, device=q.device).copy_(o)
                lse_acc = l.to(acc).contiguous()
                continue
            if out_acc is None:
                out_acc = torch.zeros(out_shape, dtype=acc, device=q.device)
                lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)
        if works is not None:
            comm.wait(works)
            cur = spare[t % 2]
    if out_acc is None:  # no task at all: every row is padding
        out_acc = torch.zeros(out_shape, dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    comm.finish()
    if sink is not None:
        apply_sink_(out_acc, lse_acc, sink)
    # A row that no task touched sees no key at all (padding under a document mask): its out
    # stays 0; give it a finite lse (0, as PyTorch's CPU flash kernel does) instead of -inf.
    lse_acc.masked_fill_(torch.isneginf(lse_acc), 0.0)
    return out_acc.to(q.dtype), lse_acc


def _send_next_block(comm, plan: RingPlan, t: int, cur, local, nxt):
    """Start the K/V transfer for step t + 1: forward the block held, or at the start of a
    chain this rank's own block."""
    send = local if plan.starts_chain(t + 1) else cur
    return comm.exchange(list(send), list(nxt), plan.steps[t + 1].shift, "kv")


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None):
    """Gradients of ring_forward, given its final out and lse (with the sink, if any: then every
    kernel's probabilities are the final ones, and dq, dk, dv need nothing else). Returns dq, dk,
    dv in the input dtypes."""
    acc = acc_dtype(q.dtype)
    rounds = plan.num_rounds
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    local = cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(list(cur), "kv") if rounds else []
    # Gradients of this rank's own K/V: its own share plus what comes home at the chains' ends.
    own_dkv = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
    dkv_bufs = comm.spare_buffers(list(own_dkv), "grad") if rounds else []
    dkv_works = None
    moves = not isinstance(comm, NoComm)  # NoComm: every step reuses the rank's own block

    for t, step in enumerate(plan.steps):
        kv_works = None
        if t < rounds:
            kv_works = _send_next_block(comm, plan, t, cur, local, spare[t % 2])
        block_grads = []  # this step's dK/dV for the block held, per task
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), seq_slice(task.k_start, task.k_end)
            dq_t, dk_t, dv_t = kernel.backward(
                dout[qs], q[qs], cur[0][ks], cur[1][ks], out[qs], lse[qs], task.lo, task.hi, scale, softcap=softcap
            )
            dq[qs] += dq_t
            block_grads.append((ks, dk_t, dv_t))
            del dq_t, dk_t, dv_t
        if t == 0:
            travelling = own_dkv  # the own block's gradients never leave
        else:
            travelling = dkv_bufs[t % 2]  # the held block's dK/dV accumulator
            if plan.starts_chain(t) or not moves:
                comm.drain()  # the buffer may still be being sent from
                travelling[0].zero_()
                travelling[1].zero_()
            else:
                comm.wait(dkv_works)  # this block's accumulator has arrived from its previous holder
            dkv_works = None
        for ks, dk_t, dv_t in block_grads:
            travelling[0][ks] += dk_t
            travelling[1][ks] += dv_t
        del block_grads
        if t > 0 and moves:
            if t < rounds and not plan.starts_chain(t + 1):
                # Pass it on to the block's next holder; it arrives while that rank computes.
                dkv_works = comm.exchange(list(travelling), list(dkv_bufs[(t + 1) % 2]), step.shift, "grad")
            else:
                # End of a chain: send it to the block's owner and take in ours. The other dK/dV
                # buffer is free here (its last send was waited on in this step).
                returned = dkv_bufs[(t + 1) % 2]
                # (src - rank is the same for every rank modulo N, so all take the same path.)
                comm.wait(comm.exchange(list(travelling), list(returned), step.src - plan.rank, "grad"))
                own_dkv[0].add_(returned[0])
                own_dkv[1].add_(returned[1])
        if kv_works is not None:
            comm.wait(kv_works)
            cur = spare[t % 2]
    comm.finish()
    return dq.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype)
