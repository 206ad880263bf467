"""The ring with its steps in groups (`dtcp.config.ring_steps_per_launch` = G > 1): forward and
backward over a `RingPlan`, on plain tensors.

The plan is the ring's (dtcp/plan/ring.py); what changes is how blocks travel and how many
launches compute on them (dtcp/plan/group.py says why):

- Each received block comes straight from its home rank: at step t this rank receives the span
  it holds from rank - d_t (d_t = rank - src, the same on every rank) and sends the same span of
  its own K/V to rank + d_t. No block is forwarded, so the G blocks of a group can all be held at
  once: the next group's G transfers are issued before the current group's launch, into the other
  of two sets of G receive buffers.
- A group's blocks run as one launch (plan/group.py `group_launches`): its keys are copied into a
  packed buffer (K/V, a small fraction of the launch's work for grouped-query heads), and its
  output merges into the float32 accumulators once. A rank whose group cannot be one launch
  runs the same received blocks step by step (the transfers are the same on every rank either way).
- Backward: dQ accumulates locally. A block's dK/dV share (float32, summed over the launch's
  sequences) goes straight home to its owner (to rank - d_t), which adds what it receives from
  rank + d_t into its own dK/dV; a group's shares are sent while the next group computes and land
  after it. The ring's travelling accumulators carry the same bytes one hop at a time.

Every transfer is a point-to-point pair on dtcp's communicator (`RingComm.exchange(...,
direct=True)`: shifts of any length; the copy engines serve neighbours only). `comm=NoComm()`
stands each block in with the rank's own span, as the ring does (the benchmarks' ideal).
"""

from __future__ import annotations

import torch

from ..comm.p2p import NoComm, fit_views
from ..config import config
from ..kernels import Kernel, acc_dtype
from ..kernels.base import seq_slice
from ..plan import RingPlan
from ..plan.group import group_launches, step_chunks
from .allgather import bounded_put
from .fused import (_indexed, add_rows_, fills_rows, fused_steps, fuses, launch_backward, launch_forward, merge_launch_,
                    rows, takes_gaps)
from .merge import apply_sink_, merge_into_
from .ring import _rows, _task_keys


def grouped(plan: RingPlan, kernel: Kernel) -> bool:
    """Does this ring call run in groups? The same answer on every rank: it depends on the
    setting, the kernel (one-launch varlen steps) and the number of steps, which every rank's plan
    shares."""
    return config.ring_steps_per_launch > 1 and plan.num_rounds >= 2 and fuses(kernel)


_GROUPS: dict = {}


def _group_indices(plan: RingPlan, kernel: Kernel, device, size: int):
    """Each group's (StepGroup, LaunchIndex or None) on `device`, or None (step by step)."""
    gaps = takes_gaps(kernel)
    key = (id(plan), kernel.name, device, size, gaps)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    groups = group_launches(plan, size, kernel.reject_varlen_reason)
    indexed = None if groups is None else tuple(
        (g, None if g.launch is None else _indexed(g.launch, device, gaps)) for g in groups)
    bounded_put(_GROUPS, key, (plan, indexed))
    return indexed


def _offset(plan: RingPlan, t: int) -> int:
    return (plan.rank - plan.steps[t].src) % plan.world_size


class _Blocks:
    """The received blocks, a group at a time: `start(i)` issues group i's transfers (each step's
    span from its home rank, this rank's span to the rank holding it), `take(i)` waits for them
    and returns [(K, V)] per step, (B, Hkv, span, D) each."""

    def __init__(self, comm, plan: RingPlan, local, chunks):
        self.comm, self.plan, self.local, self.chunks = comm, plan, local, chunks
        self.moves = not isinstance(comm, NoComm)
        self.pending: dict = {}
        if self.moves:
            longest = max(1, plan.max_span_len)
            size = max(len(c) for c in chunks)
            self.slots = [[[t.new_empty(t.shape[:2] + (longest,) + t.shape[3:]) for t in local] for _ in range(size)]
                          for _ in range(2)]

    def start(self, i: int) -> None:
        if i >= len(self.chunks) or not self.moves:
            return
        plan, got = self.plan, []
        for j, t in enumerate(self.chunks[i]):
            step = plan.steps[t]
            send = [_rows(x, *step.home_span) for x in self.local]
            recv = fit_views(self.slots[i % 2][j], [x.shape[:2] + (step.span_len,) + x.shape[3:] for x in self.local])
            got.append((self.comm.exchange(send, recv, _offset(plan, t), "kv", i % 2, direct=True), recv))
        self.pending[i] = got

    def take(self, i: int) -> list:
        if not self.moves:
            return [tuple(_rows(x, *self.plan.steps[t].span) for x in self.local) for t in self.chunks[i]]
        blocks = []
        for works, recv in self.pending.pop(i):
            self.comm.wait(works)
            blocks.append(tuple(recv))
        return blocks


def _packed(blocks, pieces, which: int, b: int) -> torch.Tensor:
    """The group launch's keys (which = 0) or values (1) of batch row b: (T_k, Hkv, D)."""
    return torch.cat([rows(blocks[j][which], b)[a:e] for j, a, e in pieces])


def grouped_forward(q, k, v, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, sink=None):
    """As exec/ring.py ring_forward (same arguments and results), the received blocks in groups."""
    acc = acc_dtype(q.dtype)
    batch, local_len = q.shape[0], q.shape[2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    local = (k.contiguous(), v.contiguous())
    size = config.ring_steps_per_launch
    chunks = step_chunks(len(plan.steps), size)
    blocks = _Blocks(comm, plan, local, chunks)
    blocks.start(0)
    fused = fused_steps(plan, kernel, q.device)
    groups = _group_indices(plan, kernel, q.device, size)

    # The local step first (while the first group's blocks arrive). Where its first launch covers
    # every row, the accumulators start as its result (no zero fill and no merge).
    fill = fused is not None and fills_rows(fused[0], local_len)
    out_acc = torch.empty(out_shape, dtype=acc, device=q.device) if fill else \
        torch.zeros(out_shape, dtype=acc, device=q.device)
    lse_acc = torch.empty(q.shape[:-1], dtype=acc, device=q.device) if fill else \
        torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    q_rows = [rows(q, b) for b in range(batch)]
    out_rows = [rows(out_acc, b) for b in range(batch)]

    def run_step(t: int, block, first: bool = False) -> None:
        step = plan.steps[t]
        if fused is not None:
            for b in range(batch):
                k_b, v_b = rows(block[0], b), rows(block[1], b)
                for i, li in enumerate(fused[t]):
                    o, l = launch_forward(kernel, q_rows[b], k_b, v_b, li, scale, softcap)
                    if first and i == 0:
                        out_rows[b].copy_(o)
                        lse_acc[b].copy_(l)
                    else:
                        merge_launch_(out_rows[b], lse_acc[b], li, o, l)
            return
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            o, l = kernel.forward(q[qs], block[0][ks], block[1][ks], task.lo, task.hi, scale, softcap=softcap)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)

    run_step(0, tuple(_rows(x, *plan.steps[0].span) for x in local), first=fill)
    for i, chunk in enumerate(chunks):
        blocks.start(i + 1)  # the next group's transfers run under this group's launch
        held = blocks.take(i)
        if groups is None:
            for t, block in zip(chunk, held):
                run_step(t, block)
            continue
        group, li = groups[i]
        if li is None:
            continue
        for b in range(batch):
            o, l = launch_forward(kernel, q_rows[b], _packed(held, group.pieces, 0, b),
                                  _packed(held, group.pieces, 1, b), li, scale, softcap)
            merge_launch_(out_rows[b], lse_acc[b], li, o, l)
    comm.finish()
    if sink is not None:
        apply_sink_(out_acc, lse_acc, sink)
    # rows no task touched (padding under a document mask): out 0, lse 0 (as the ring)
    lse_acc.masked_fill_(torch.isneginf(lse_acc), 0.0)
    return out_acc.to(q.dtype), lse_acc


def grouped_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None):
    """As exec/ring.py ring_backward (same arguments and results), the received blocks in groups."""
    acc = acc_dtype(q.dtype)
    batch = q.shape[0]
    local = (k.contiguous(), v.contiguous())
    size = config.ring_steps_per_launch
    chunks = step_chunks(len(plan.steps), size)
    blocks = _Blocks(comm, plan, local, chunks)
    blocks.start(0)
    moves = blocks.moves
    fused = fused_steps(plan, kernel, q.device)
    groups = _group_indices(plan, kernel, q.device, size)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    own_dkv = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
    fixed = [[rows(x, b) for x in (dout, q, out, dq_acc)] for b in range(batch)]

    def run_step(t: int, block, dkv) -> None:
        """Step t's dQ into dq_acc and its dK/dV into dkv, (B, Hkv, span, D) float32 each."""
        step = plan.steps[t]
        if fused is not None:
            for b in range(batch):
                dout_b, q_b, out_b, dq_b = fixed[b]
                k_b, v_b = rows(block[0], b), rows(block[1], b)
                for li in fused[t]:
                    dq_t, dk_t, dv_t = launch_backward(kernel, dout_b, q_b, k_b, v_b, out_b, lse[b], li, scale, softcap)
                    add_rows_(dq_b, li.q, dq_t)
                    add_rows_(rows(dkv[0], b), li.k, dk_t)
                    add_rows_(rows(dkv[1], b), li.k, dv_t)
            return
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            dq_t, dk_t, dv_t = kernel.backward(dout[qs], q[qs], block[0][ks], block[1][ks], out[qs], lse[qs],
                                               task.lo, task.hi, scale, softcap=softcap)
            dq_acc[qs].add_(dq_t)
            dkv[0][ks].add_(dk_t)
            dkv[1][ks].add_(dv_t)

    def shares_of(chunk) -> list:
        return [tuple(torch.zeros(x.shape[:2] + (plan.steps[t].span_len,) + x.shape[3:], dtype=acc, device=x.device)
                      for x in local) for t in chunk]

    def send_home(i: int, chunk, shares) -> list:
        """Start sending each step's share to the block's owner; receive ours from its holder."""
        sent = []
        for j, t in enumerate(chunk):
            step = plan.steps[t]
            home = [x.shape[:2] + (step.home_span[1] - step.home_span[0],) + x.shape[3:] for x in local]
            incoming = [torch.empty(shape, dtype=acc, device=k.device) for shape in home]
            # (NoComm: nothing comes home, but the owner's add of it is timed)
            works = comm.exchange(list(shares[j]), incoming, -_offset(plan, t), "grad", i % 2, direct=True) \
                if moves else None
            sent.append((step.home_span, works, incoming))
        return sent

    def land(sent) -> None:
        for span, works, incoming in sent:
            if works is not None:
                comm.wait(works)
            for mine, got in zip(own_dkv, incoming):
                _rows(mine, *span).add_(got)

    run_step(0, tuple(_rows(x, *plan.steps[0].span) for x in local),
             tuple(_rows(x, *plan.steps[0].span) for x in own_dkv))
    in_flight = None
    for i, chunk in enumerate(chunks):
        blocks.start(i + 1)
        held = blocks.take(i)
        shares = shares_of(chunk)
        if groups is None:
            for t, block, dkv in zip(chunk, held, shares):
                run_step(t, block, dkv)
        else:
            group, li = groups[i]
            for b in range(batch) if li is not None else ():
                dout_b, q_b, out_b, dq_b = fixed[b]
                dq_t, dk_t, dv_t = launch_backward(kernel, dout_b, q_b, _packed(held, group.pieces, 0, b),
                                                   _packed(held, group.pieces, 1, b), out_b, lse[b], li, scale, softcap)
                add_rows_(dq_b, li.q, dq_t)
                off = 0
                for j, a, e in group.pieces:  # each run's share onto its block (a key packed twice: both)
                    rows(shares[j][0], b)[a:e].add_(dk_t[off:off + e - a])
                    rows(shares[j][1], b)[a:e].add_(dv_t[off:off + e - a])
                    off += e - a
        if in_flight is not None:
            land(in_flight)  # the previous group's shares, sent while this group computed
        in_flight = send_home(i, chunk, shares)
    if in_flight is not None:
        land(in_flight)
    comm.finish()
    return dq_acc.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype)
