"""The ring with its steps in groups (`dtcp.config.ring_steps_per_launch` = G > 1, or "auto"
and the cost model's choice: exec/route.py ring_steps): forward and
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
from ..kernels import Kernel, acc_dtype
from ..kernels.base import seq_slice
from ..plan import RingPlan
from ..plan.fuse import later_keys
from ..plan.group import group_launches, share_writes, step_chunks
from .allgather import bounded_put
from .fused import (_indexed, add_rows_, backward_launch_, direct_results, fills_keys, fills_rows, finish_gradients,
                    finish_results, fused_steps, fuses, gradient_results, landing, launch_forward, merge_launch_,
                    rows, seed_later_, takes_gaps)
from .merge import apply_sink_, merge_into_
from .ring import _rows, _task_keys


def grouped(plan: RingPlan, kernel: Kernel, size: int) -> bool:
    """Does this ring call run in groups of `size` (its route's steps_per_launch)? The same answer
    on every rank: it depends on the size, the kernel (one-launch varlen steps) and the number of
    steps, which every rank's plan shares."""
    return size > 1 and plan.num_rounds >= 2 and fuses(kernel)


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


def _packed(blocks, pieces, packed_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group launch's keys and values, (B, Hkv, T_k, D) each: the pieces' keys one after
    another. Head-major, as the blocks are: one copy a piece for every batch row, of whole rows
    per head, and the launch reads rows views of them (exec/fused.py `rows`). (A token-major
    buffer, torch.cat of rows views per batch row, transposed every key: on one H100, causal 32K
    at N = 8 in one group, the pass's packing took 0.33 ms, head-major 0.30.)"""
    packed = []
    for which in (0, 1):
        like = blocks[0][which]
        buf = like.new_empty(like.shape[:2] + (packed_len,) + like.shape[3:])
        off = 0
        for j, a, e in pieces:
            buf[:, :, off:off + e - a].copy_(blocks[j][which][:, :, a:e])
            off += e - a
        packed.append(buf)
    return packed[0], packed[1]


def _launches(fused, groups) -> tuple:
    """The pass's launches, a tuple per launch site: the local step's, then each group's (or,
    where the rank runs its received blocks step by step, each step's), for plan/fuse.py's
    later_rows / later_keys."""
    local = tuple(li.launch for li in fused[0])
    if groups is None:
        return (local,) + tuple(tuple(li.launch for li in step) for step in fused[1:])
    return (local,) + tuple((g.launch,) for g, _ in groups if g.launch is not None)


def _sites(fused, groups) -> tuple:
    """_launches as LaunchIndex (exec/fused.py landing): the local step's, then each group's."""
    if groups is None:
        return fused
    return (fused[0],) + tuple((li,) for _, li in groups if li is not None)


def grouped_forward(q, k, v, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, sink=None, *, size: int):
    """As exec/ring.py ring_forward (same arguments and results), the received blocks in groups of
    `size` steps."""
    acc = acc_dtype(q.dtype)
    batch, local_len = q.shape[0], q.shape[2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    local = (k.contiguous(), v.contiguous())
    chunks = step_chunks(len(plan.steps), size)
    blocks = _Blocks(comm, plan, local, chunks)
    blocks.start(0)
    fused = fused_steps(plan, kernel, q.device)
    groups = _group_indices(plan, kernel, q.device, size)

    # The local step first (while the first group's blocks arrive). As in the ring: where its
    # first launch covers every row, it writes out and lse straight into the results, and the
    # group launches land their rows run by run (exec/fused.py Landing; else the hull `later` goes
    # through float32); with a sink every row's result changes after the merge, so float32 covers
    # every row.
    direct = sink is None and fused is not None and fills_rows(fused[0], local_len)
    land = landing(_sites(fused, groups), takes_gaps(kernel)) if direct else None
    later = land.seed if direct else (0, local_len)
    out = None
    if direct:
        out, out_acc = direct_results(out_shape, q.dtype, acc, q.device, land.acc)
        lse_acc = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    else:
        out_acc = torch.zeros(out_shape, dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    q_rows = [rows(q, b) for b in range(batch)]
    out_rows = [rows(out_acc, b) for b in range(batch)]

    def landed(b: int, li) -> tuple:  # merge_launch_'s (result rows, landing) where the first launch wrote the results
        return (rows(out, b), land) if direct else (None, None)

    def run_step(t: int, block) -> None:
        step = plan.steps[t]
        if fused is not None:
            for b in range(batch):
                k_b, v_b = rows(block[0], b), rows(block[1], b)
                for i, li in enumerate(fused[t]):
                    if direct and t == 0 and i == 0:
                        final = rows(out, b)
                        launch_forward(kernel, q_rows[b], k_b, v_b, li, scale, softcap, into=(final, lse_acc[b]))
                        seed_later_(out_rows[b], final, later)
                        continue
                    o, l = launch_forward(kernel, q_rows[b], k_b, v_b, li, scale, softcap)
                    merge_launch_(out_rows[b], lse_acc[b], li, o, l, *landed(b, li))
            return
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            o, l = kernel.forward(q[qs], block[0][ks], block[1][ks], task.lo, task.hi, scale, softcap=softcap)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)

    run_step(0, tuple(_rows(x, *plan.steps[0].span) for x in local))
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
        kp, vp = _packed(held, group.pieces, group.packed_len)
        for b in range(batch):
            o, l = launch_forward(kernel, q_rows[b], rows(kp, b), rows(vp, b), li, scale, softcap)
            merge_launch_(out_rows[b], lse_acc[b], li, o, l, *landed(b, li))
    comm.finish()
    if sink is not None:
        apply_sink_(out_acc, lse_acc, sink)
    # rows no task touched (padding under a document mask): out 0, lse 0 (as the ring)
    lse_acc.masked_fill_(torch.isneginf(lse_acc), 0.0)
    if direct:
        return finish_results(out, out_acc, later), lse_acc
    return out_acc.to(q.dtype), lse_acc


def grouped_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, *,
                     size: int):
    """As exec/ring.py ring_backward (same arguments and results), the received blocks in groups of
    `size` steps."""
    acc = acc_dtype(q.dtype)
    batch, local_len = q.shape[0], q.shape[2]
    local = (k.contiguous(), v.contiguous())
    chunks = step_chunks(len(plan.steps), size)
    blocks = _Blocks(comm, plan, local, chunks)
    blocks.start(0)
    moves = blocks.moves
    fused = fused_steps(plan, kernel, q.device)
    groups = _group_indices(plan, kernel, q.device, size)
    # As the ring's: where the local step's first launch covers every row (every key of the
    # rank's block), it writes dQ (dK/dV) straight into the results; later launches add dQ run
    # by run (exec/fused.py Landing, as the forward's rows), and float32 holds only the hull of the
    # keys more launches or the shares coming home add to.
    fill_q = fused is not None and fills_rows(fused[0], local_len)
    fill_kv = fused is not None and fills_keys(fused[0], k.shape[2])
    launches = _launches(fused, groups) if fill_q or fill_kv else None
    land_q = landing(_sites(fused, groups), takes_gaps(kernel)) if fill_q else None  # (as the forward's rows)
    later_q = land_q.seed if fill_q else (0, 0)
    # (every received step's share comes home; with NoComm nothing does, but the adds are timed)
    later_kv = later_keys(launches, plan.used_keys) if fill_kv else (0, 0)

    dq_out, dq_acc = gradient_results(q, acc, fill_q, land_q.acc if fill_q else (0, 0))
    (dk_out, dk_acc), (dv_out, dv_acc) = (gradient_results(x, acc, fill_kv, later_kv) for x in (k, v))
    own_dkv = (dk_acc, dv_acc)
    fixed = [[rows(x, b) for x in (dout, q, out, dq_acc)] for b in range(batch)]

    def run_step(t: int, block, dkv) -> None:
        """Step t's dQ into dq_acc and its dK/dV into dkv, (B, Hkv, span, D) float32 each."""
        step = plan.steps[t]
        if fused is not None:
            for b in range(batch):
                k_b, v_b = rows(block[0], b), rows(block[1], b)
                for i, li in enumerate(fused[t]):
                    first = t == 0 and i == 0
                    grads = backward_launch_(kernel, fixed[b], k_b, v_b, lse[b], li, scale, softcap, b,
                                             into_q=dq_out if first and fill_q else None,
                                             into_kv=(dk_out, dv_out) if first and fill_kv else None,
                                             later_q=later_q, dkv_acc=dkv, later_kv=later_kv,
                                             dq_result=dq_out, land_q=land_q)
                    for acc, got in zip(dkv, grads or ()):
                        add_rows_(rows(acc, b), li.k, got)
            return
        for task in step.tasks:
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            dq_t, dk_t, dv_t = kernel.backward(dout[qs], q[qs], block[0][ks], block[1][ks], out[qs], lse[qs],
                                               task.lo, task.hi, scale, softcap=softcap)
            dq_acc[qs].add_(dq_t)
            dkv[0][ks].add_(dk_t)
            dkv[1][ks].add_(dv_t)

    def new_shares(chunk, zero: bool) -> list:
        alloc = torch.zeros if zero else torch.empty
        return [tuple(alloc(x.shape[:2] + (plan.steps[t].span_len,) + x.shape[3:], dtype=acc, device=x.device)
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

    step0 = plan.steps[0].span
    run_step(0, tuple(_rows(x, *step0) for x in local), tuple(_rows(x, *step0) for x in own_dkv))
    in_flight = None
    for i, chunk in enumerate(chunks):
        blocks.start(i + 1)
        held = blocks.take(i)
        if groups is None:
            shares = new_shares(chunk, zero=True)
            for t, block, dkv in zip(chunk, held, shares):
                run_step(t, block, dkv)
        else:
            group, li = groups[i]
            shares = new_shares(chunk, zero=li is None)
            # each key's first share is copied in, later ones added, keys no piece holds zeroed
            writes = share_writes(group, tuple(plan.steps[t].span_len for t in chunk)) if li is not None else ()
            kp, vp = _packed(held, group.pieces, group.packed_len) if li is not None else (None, None)
            for b in range(batch) if li is not None else ():
                grads = backward_launch_(kernel, fixed[b], rows(kp, b), rows(vp, b), lse[b], li, scale, softcap, b,
                                         dq_result=dq_out, land_q=land_q)
                for share, (step_writes, zeros) in zip(shares, writes):
                    for mine, got in zip(share, grads):
                        mine_b = rows(mine, b)
                        for first, a, e, off in step_writes:
                            if first:
                                mine_b[a:e].copy_(got[off:off + e - a])
                            else:
                                mine_b[a:e].add_(got[off:off + e - a])
                        for a, e in zeros:
                            mine_b[a:e].zero_()
        if in_flight is not None:
            land(in_flight)  # the previous group's shares, sent while this group computed
        in_flight = send_home(i, chunk, shares)
    if in_flight is not None:
        land(in_flight)
    comm.finish()
    return finish_gradients(((dq_out, dq_acc, later_q, q), (dk_out, dk_acc, later_kv, k),
                             (dv_out, dv_acc, later_kv, v)))
