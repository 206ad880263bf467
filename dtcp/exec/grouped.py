"""The ring with its steps in groups (`dtcp.config.ring_steps_per_launch` = G > 1, or "auto"
and the cost model's choice: exec/route.py ring_steps): forward and
backward over a `RingPlan`, on plain tensors.

The plan is the ring's (dtcp/plan/ring.py); what changes is how blocks travel and how many
launches compute on them (dtcp/plan/group.py says why):

- Each received block comes straight from its home rank: at step t this rank receives the keys
  it uses of rank - d_t's block (Step.direct_span; d_t = rank - src, the same on every rank) and
  sends the keys rank + d_t uses of its own (Step.direct_home_span) to it. No block is
  forwarded, so the G blocks of a group can all be held at once: the next group's G transfers are
  issued before the current group's launches, into the other of two receive buffers.
- A group's blocks land in its buffer one after another, token-major ((keys, B, Hkv, D): a block
  is one contiguous piece of it, and the launches read keys with any token stride). The wire
  is the same on every rank, whatever its groups run as.
- In place (plan/group.py InPlaceGroup, where the group's sequences allow it): the launches read
  the buffer as it is, and write their dK/dV into a buffer of the same shape whose slices go home
  as the steps' shares. No key is copied.
- Packed (StepGroup): the group's keys are copied into a packed buffer for its one launch; each
  step's dK/dV share is copied (added) out of the launch's.
- A rank whose group can be neither runs the same received blocks step by step.
- Backward: dQ accumulates locally. A block's dK/dV share goes straight home to its owner (to
  rank - d_t) in the inputs' dtype, as the kernel gives it; the owner adds what it receives from
  rank + d_t into its own dK/dV in float32. A group's shares are sent while the next group
  computes and land after it. (The ring's travelling accumulators carry running float32 sums one
  hop at a time: twice the bytes for bf16.)

Every transfer is a point-to-point pair on dtcp's communicator (`RingComm.exchange(...,
direct=True)`: shifts of any length; the copy engines serve neighbours only). `comm=NoComm()`
stands each block in with the rank's own keys, as the ring does (the benchmarks' ideal); an
in-place group reads a buffer of them that NoComm keeps (`NoComm.stand_in`: what the receives
would write, made once), and the sender's token-major copy is made and timed as with a transport.
"""

from __future__ import annotations

import torch

from ..comm.p2p import NoComm
from ..config import config
from ..kernels import Kernel, acc_dtype
from ..kernels.base import seq_slice
from ..plan import RingPlan
from ..plan.fuse import later_keys
from ..plan.group import InPlaceGroup, group_launches, share_writes, step_chunks
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
    """Each group's (InPlaceGroup or StepGroup, its launches as LaunchIndex) on `device`, or None
    (step by step)."""
    gaps, in_place = takes_gaps(kernel), config.ring_groups_in_place
    key = (id(plan), kernel.name, device, size, gaps, in_place)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    groups = group_launches(plan, size, kernel.reject_varlen_reason, in_place)
    indexed = None if groups is None else tuple(
        (g, tuple(_indexed(launch, device, gaps) for launch in g.launches)) for g in groups)
    bounded_put(_GROUPS, key, (plan, indexed))
    return indexed


def _offset(plan: RingPlan, t: int) -> int:
    return (plan.rank - plan.steps[t].src) % plan.world_size


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (L, B, H, D), a view."""
    return x.permute(2, 0, 1, 3)


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """(L, B, H, D) -> (B, H, L, D), a view (what the step-by-step and packed paths index)."""
    return x.permute(1, 2, 0, 3)


def _keys_at(chunk, plan: RingPlan) -> list[tuple[int, int]]:
    """Where each step of a group lands in its buffer: [start, end) rows, one after another."""
    at, out = 0, []
    for t in chunk:
        out.append((at, at + plan.steps[t].direct_len))
        at += plan.steps[t].direct_len
    return out


class _Blocks:
    """The received blocks, a group at a time: `start(i)` issues group i's transfers (each step's
    direct span from its home rank; this rank's keys to the rank holding them then) into one of
    two buffers (keys, B, Hkv, D), the steps' keys one after another; `take(i)` waits for them and
    returns (K, V) of the whole group (in place) or [(K, V)] per step as (B, Hkv, span, D) views
    (step by step, packed)."""

    def __init__(self, comm, plan: RingPlan, local, chunks, groups):
        self.comm, self.plan, self.local, self.chunks = comm, plan, local, chunks
        self.in_place = [groups is not None and isinstance(groups[i][0], InPlaceGroup) for i in range(len(chunks))]
        self.at = [_keys_at(chunk, plan) for chunk in chunks]
        self.moves = not isinstance(comm, NoComm)
        self.pending: dict = {}
        self.held: dict = {}
        rows = max([at[-1][1] for at in self.at if at] + [0])
        self.bufs = [[x.new_empty((rows,) + x.shape[:2] + x.shape[3:]) for x in local] for _ in range(2)] \
            if self.moves else None
        # this rank's K/V token-major, once a pass: every send a contiguous slice of it (and, with
        # NoComm, what an in-place group's stand-in buffer is made of)
        self.sent = [_token_major(x).contiguous() for x in local] if self.moves or any(self.in_place) else None

    def start(self, i: int) -> None:
        if i >= len(self.chunks):
            return
        plan, got = self.plan, []
        if not self.moves:
            if self.in_place[i]:  # what the receives would have written: the rank's own keys (NoComm.stand_in)
                chunk = self.chunks[i]
                self.held[i] = tuple(self.comm.stand_in(
                    (id(plan), i, which, x.shape, x.dtype, x.device),
                    lambda x=x: torch.cat([x[slice(*plan.steps[t].direct_span)] for t in chunk]), plan)
                    for which, x in enumerate(self.sent))
            return
        bufs = self.bufs[i % 2]
        for (a, e), t in zip(self.at[i], self.chunks[i]):
            step = plan.steps[t]
            send = [x[step.direct_home_span[0]:step.direct_home_span[1]] for x in self.sent]
            got.append(self.comm.exchange(send, [buf[a:e] for buf in bufs], _offset(plan, t), "kv", i % 2,
                                          direct=True))
        self.pending[i] = got

    def take(self, i: int):
        plan, chunk = self.plan, self.chunks[i]
        if self.moves:
            for works in self.pending.pop(i):
                self.comm.wait(works)
        if self.in_place[i]:
            if not self.moves:
                return self.held.pop(i)
            end = self.at[i][-1][1]
            return tuple(buf[:end] for buf in self.bufs[i % 2])
        if not self.moves:
            return [tuple(_rows(x, *plan.steps[t].direct_span) for x in self.local) for t in chunk]
        return [tuple(_head_major(buf[a:e]) for buf in self.bufs[i % 2]) for a, e in self.at[i]]


def _packed(blocks, pieces, packed_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group launch's keys and values, (B, Hkv, T_k, D) each: the pieces' keys one after
    another. Head-major: one copy a piece for every batch row, of whole rows per head, and the
    launch reads rows views of them (exec/fused.py `rows`). (A token-major buffer, torch.cat of
    rows views per batch row, transposed every key: on one H100, causal 32K at N = 8 in one group,
    the pass's packing took 0.33 ms, head-major 0.30.)"""
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
    return (local,) + tuple(g.launches for g, _ in groups if g.launches)


def _sites(fused, groups) -> tuple:
    """_launches as LaunchIndex (exec/fused.py landing): the local step's, then each group's."""
    if groups is None:
        return fused
    return (fused[0],) + tuple(lis for _, lis in groups if lis)


def grouped_forward(q, k, v, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, sink=None, *, size: int):
    """As exec/ring.py ring_forward (same arguments and results), the received blocks in groups of
    `size` steps."""
    acc = acc_dtype(q.dtype)
    batch, local_len = q.shape[0], q.shape[2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    local = (k.contiguous(), v.contiguous())
    chunks = step_chunks(len(plan.steps), size)
    fused = fused_steps(plan, kernel, q.device, direct=True)
    groups = _group_indices(plan, kernel, q.device, size)
    blocks = _Blocks(comm, plan, local, chunks, groups)
    blocks.start(0)

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
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step, direct=True)
            o, l = kernel.forward(q[qs], block[0][ks], block[1][ks], task.lo, task.hi, scale, softcap=softcap)
            merge_into_(out_acc[qs], lse_acc[qs], o, l)

    def run_launches(lis, b: int, k_rows, v_rows) -> None:  # batch row b's launches of a group
        for li in lis:
            o, l = launch_forward(kernel, q_rows[b], k_rows, v_rows, li, scale, softcap)
            merge_launch_(out_rows[b], lse_acc[b], li, o, l, *landed(b, li))

    run_step(0, tuple(_rows(x, *plan.steps[0].span) for x in local))
    for i, chunk in enumerate(chunks):
        blocks.start(i + 1)  # the next group's transfers run under this group's launches
        held = blocks.take(i)
        if groups is None:
            for t, block in zip(chunk, held):
                run_step(t, block)
            continue
        group, lis = groups[i]
        if not lis:
            continue
        if isinstance(group, InPlaceGroup):
            for b in range(batch):  # the buffer's keys as rows: (keys, Hkv, D), read in place
                run_launches(lis, b, held[0][:, b], held[1][:, b])
            continue
        kp, vp = _packed(held, group.pieces, group.packed_len)
        for b in range(batch):
            run_launches(lis, b, rows(kp, b), rows(vp, b))
    comm.finish()
    if sink is not None:
        apply_sink_(out_acc, lse_acc, sink)
    # rows no task touched (padding under a document mask): out 0, lse 0 (as the ring)
    lse_acc.masked_fill_(torch.isneginf(lse_acc), 0.0)
    if direct:
        return finish_results(out, out_acc, later), lse_acc
    return out_acc.to(q.dtype), lse_acc


def grouped_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None,
                     kv_dtype=None, *, size: int):
    """As exec/ring.py ring_backward (same arguments and results), the received blocks in groups of
    `size` steps."""
    acc = acc_dtype(q.dtype)
    batch, local_len = q.shape[0], q.shape[2]
    local = (k.contiguous(), v.contiguous())
    chunks = step_chunks(len(plan.steps), size)
    fused = fused_steps(plan, kernel, q.device, direct=True)
    groups = _group_indices(plan, kernel, q.device, size)
    blocks = _Blocks(comm, plan, local, chunks, groups)
    blocks.start(0)
    moves = blocks.moves
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
    later_kv = later_keys(launches, plan.direct_used_keys) if fill_kv else (0, 0)

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
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step, direct=True)
            dq_t, dk_t, dv_t = kernel.backward(dout[qs], q[qs], block[0][ks], block[1][ks], out[qs], lse[qs],
                                               task.lo, task.hi, scale, softcap=softcap)
            dq_acc[qs].add_(dq_t)
            dkv[0][ks].add_(dk_t)
            dkv[1][ks].add_(dv_t)

    def new_shares(i: int, zero: bool) -> tuple:
        """Group i's dK/dV shares, (keys, B, Hkv, D) float32 each, the steps' one after another
        (as its blocks came: each step's share is a contiguous slice that goes home)."""
        alloc = torch.zeros if zero else torch.empty
        length = blocks.at[i][-1][1]
        return tuple(alloc((length,) + x.shape[:2] + x.shape[3:], dtype=acc, device=x.device) for x in local)

    def in_place_shares(group: InPlaceGroup, lis, held) -> tuple:
        """An in-place group's launches, each writing its dK/dV into its own rows of a buffer like
        the received one (in the inputs' dtype, as the kernel gives them: the shares go home as
        they are); the rows no launch reads zeroed."""
        dkv = tuple(torch.empty(x.shape[:1] + y.shape[:2] + y.shape[3:], dtype=y.dtype, device=y.device)
                    for x, y in zip(held, local))
        for b in range(batch):
            for li in lis:
                a, e = li.k.span
                backward_launch_(kernel, fixed[b], held[0][:, b], held[1][:, b], lse[b], li, scale, softcap, b,
                                 dq_result=dq_out, land_q=land_q, dkv_into=(dkv[0][a:e, b], dkv[1][a:e, b]))
        for a, e in group.zeros:
            for x in dkv:
                x[a:e].zero_()
        return dkv

    def packed_shares(i: int, group, lis, held) -> tuple:
        """A packed group's launch, each step's share copied (added) out of its dK/dV: each key's
        first share is copied in, later ones added, keys no piece holds zeroed."""
        shares = new_shares(i, zero=False)
        span_lens = tuple(e - a for a, e in blocks.at[i])
        writes = share_writes(group, span_lens)
        kp, vp = _packed(held, group.pieces, group.packed_len)
        for b in range(batch):
            grads = backward_launch_(kernel, fixed[b], rows(kp, b), rows(vp, b), lse[b], lis[0], scale, softcap, b,
                                     dq_result=dq_out, land_q=land_q)
            for (a0, _), (step_writes, zeros) in zip(blocks.at[i], writes):
                for mine, got in zip(shares, grads):
                    mine_b = mine[a0:, b]
                    for first, a, e, off in step_writes:
                        if first:
                            mine_b[a:e].copy_(got[off:off + e - a])
                        else:
                            mine_b[a:e].add_(got[off:off + e - a])
                    for a, e in zeros:
                        mine_b[a:e].zero_()
        return shares

    def send_home(i: int, chunk, shares) -> tuple:
        """Start sending each step's share to the block's owner; receive ours from its holder. Shares
        travel in the inputs' dtype: a step's share is the kernel's dK/dV as it gave them (in place:
        the same bits; a float32 sum of a key's two shares in a packed launch, or of a step's
        launches step by step, is rounded once), and the owner adds them in float32. The shares
        coming home for the same keys land in one buffer, (shares, keys, B, Hkv, D), summed by one
        reduction: under a causal zigzag mask a group's shares come home for two spans, and one add
        a share cost 0.25 ms a pass at N = 8 (one H200)."""
        shares = [x if x.dtype == like.dtype else x.to(like.dtype) for x, like in zip(shares, local)]
        spans = [plan.steps[t].direct_home_span for t in chunk]
        slots: dict = {}  # home span -> the steps coming home for it
        for j, span in enumerate(spans):
            slots.setdefault(span, []).append(j)
        incoming = {span: [torch.empty((len(js), span[1] - span[0]) + x.shape[:2] + x.shape[3:], dtype=x.dtype,
                                       device=x.device) for x in local] for span, js in slots.items()}
        works = []
        for j, ((a, e), t) in enumerate(zip(blocks.at[i], chunk)):
            recv = [buf[slots[spans[j]].index(j)] for buf in incoming[spans[j]]]
            # (NoComm: nothing comes home, but the owner's sum and add of it are timed)
            works.append(comm.exchange([x[a:e] for x in shares], recv, -_offset(plan, t), "grad", i % 2,
                                       direct=True) if moves else None)
        return works, incoming

    def land(sent) -> None:
        works, incoming = sent
        for got in works:
            if got is not None:
                comm.wait(got)
        for span, bufs in incoming.items():
            if span[1] <= span[0]:
                continue
            for mine, got in zip(own_dkv, bufs):
                total = got[0] if len(got) == 1 else got.sum(0, dtype=acc)
                _rows(mine, *span).add_(_head_major(total))

    step0 = plan.steps[0].span
    run_step(0, tuple(_rows(x, *step0) for x in local), tuple(_rows(x, *step0) for x in own_dkv))
    in_flight = None
    for i, chunk in enumerate(chunks):
        blocks.start(i + 1)
        held = blocks.take(i)
        if groups is None:
            shares = new_shares(i, zero=True)
            views = [tuple(_head_major(x[a:e]) for x in shares) for a, e in blocks.at[i]]
            for t, block, dkv in zip(chunk, held, views):
                run_step(t, block, dkv)
        else:
            group, lis = groups[i]
            if not lis:
                shares = new_shares(i, zero=True)
            elif isinstance(group, InPlaceGroup):
                shares = in_place_shares(group, lis, held)
            else:
                shares = packed_shares(i, group, lis, held)
        if in_flight is not None:
            land(in_flight)  # the previous group's shares, sent while this group computed
        in_flight = send_home(i, chunk, shares)
    if in_flight is not None:
        land(in_flight)
    comm.finish()
    return finish_gradients(((dq_out, dq_acc, later_q, q), (dk_out, dk_acc, later_kv, k),
                             (dv_out, dv_acc, later_kv, v)), kv_dtype)
