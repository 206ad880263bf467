"""The ring itself: forward and backward loops over a `RingPlan`, on plain tensors.

Forward: Q stays; K/V blocks travel one rank per step, each with only the keys its holders use
(its span, dtcp/plan/ring.py). The next block's transfer is issued before the current block's
kernels so communication overlaps compute. Partial results merge into float32 (out, lse)
accumulators (float64 for float64 inputs); when the local block's kernel calls are disjoint (one
call, or one per document), or its first one-launch step covers every row (written straight into
the results), only the rows later blocks reach get one, and the rest keep the local call's result
as the kernel returned it. With one-launch steps a row that only one later launch reaches merges
straight into the result too, and a row several reach is read from the result by the first and
written back by the last (exec/fused.py `Landing`, plan/fuse.py `row_runs`).

Plans may have fewer steps than ranks (sliding windows, documents) and up to two chains: blocks
travel forward (shift +1) and then backward (shift -1); the first step of a chain receives the
sender's own K/V (see dtcp/plan/ring.py). Each chain sends only the blocks it uses.

Where the local step writes the results (its first launch covers every row, or its tasks are
disjoint and kept), the later launches or tasks write their outputs and lse into slots instead,
merged into the results once at the end of the pass (exec/fused.py Slots, exec/merge.py
merge_slots_; up to `config.merge_slots_bytes`): no float32 accumulator read and written between
them, and in the backward their dQ likewise (sum_slots_). A launch whose rows lie apart in a window
(a Balanced rank's high chunks, which a later rank's low chunks reach) is kept as its window; only
launches whose rows are gathered (a kernel that cannot read them apart) land launch by launch.

Backward: dQ accumulates locally, and so does the share of a rank's own block. For the other
blocks a dK/dV accumulator (float32) starts at the first holder of a chain and travels with the
block one step behind its K/V: a rank adds its share after computing and passes it on. At the end
of a chain the accumulator is sent home, so each rank ends with the gradients of its own K/V. The
backward sends exactly as many dK/dV blocks as K/V blocks. A chain of one hop whose holder takes
each key once (plan/ring.py Step.one_share: every ring of 2 ranks) holds one kernel share per key:
its accumulator is kept and sent home in the kernel's gradient dtype (bf16 under bf16: half the
bytes, the same values) and added in float32 at home.

Buffers: the caller's K/V are sent as they are and never written; two spare K/V buffers and two
dK/dV buffers, sized for the largest span received, alternate (copy-engine slots reused across
calls, else allocated once per call); each round receives into a view fitted to its span.
`comm=NoComm()` runs the same kernels and merges with no communication (the benchmarks' ideal).
"""

from __future__ import annotations

import torch

from ..comm.p2p import NoComm
from ..config import config
from ..kernels import Kernel, acc_dtype
from ..kernels.base import landed, seq_slice
from ..plan import RingPlan
from ..plan.fuse import later_keys
from .fused import (add_rows_, backward_launch_, direct_results, fills_keys, fills_rows, finish_gradients,
                    finish_results, fused_steps, gradient_results, landing, launch_forward, launches_of, merge_launch_,
                    pass_slots, rows, seed_later_, slot_lse, slot_rows, takes_gaps, task_slots)
from .merge import apply_sink_, merge_into_, merge_slots_, sum_slots_


def _covers_all_rows(step, local_len: int) -> bool:
    return len(step.tasks) == 1 and step.tasks[0].q_start == 0 and step.tasks[0].q_end == local_len


def _whole_or_zeros(result: torch.Tensor, shape, dtype, covers_all: bool) -> torch.Tensor:
    """The tensor the local calls' results are written into: the one call's own result when it
    covers everything (contiguous, in `dtype`), else zeros (rows no call touches: padding)."""
    if covers_all:
        return result.to(dtype).contiguous()
    return torch.zeros(shape, dtype=dtype, device=result.device)


def _rows(x: torch.Tensor, start: int, end: int, origin: int = 0) -> torch.Tensor:
    """x[:, :, start - origin:end - origin]: rows (keys) [start, end) of a (B, H, L, D) tensor
    holding them from `origin`. A view; contiguous when it is all of x."""
    return x[seq_slice(start - origin, end - origin)]


def _shapes(like, span_len: int) -> list[tuple]:
    return [(t.shape[0], t.shape[1], span_len, t.shape[3]) for t in like]


def _slot_like(pair, plan: RingPlan) -> list[torch.Tensor]:
    """Views (no copy) shaped like the largest span this rank receives, to size spare slots by;
    at least one key, so that every slot has an address."""
    n = max(1, plan.max_span_len)
    return [t[:, :, :n] if t.shape[2] >= n else t.new_empty(t.shape[:2] + (n,) + t.shape[3:]) for t in pair]


def _task_keys(task, step, direct: bool = False) -> tuple:
    """The task's keys as a slice of the held span (`direct`: of the direct span, what the ring
    in groups receives, exec/grouped.py)."""
    origin = (step.direct_span if direct else step.span)[0]
    return seq_slice(task.k_start - origin, task.k_end - origin)


def ring_forward(q, k, v, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None, sink=None):
    """q: (B, Hq, L, D), k: (B, Hkv, L, D), v: (B, Hkv, L, Dv), this rank's shards; sink: (Hq,) or
    None, added once per row after the merge. Returns out (B, Hq, L, Dv) in q.dtype and lse
    (B, Hq, L) float32 (float64 for float64)."""
    acc = acc_dtype(q.dtype)
    local_len = q.shape[2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    local = cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(_slot_like(local, plan), "kv") if plan.num_rounds else []
    fit = _fitter(comm)
    moves = not isinstance(comm, NoComm)  # NoComm: every step reuses the rank's own block
    # When the local step's calls are disjoint (one over the whole block, or one per document),
    # the rows no later step touches keep their call's output as the kernel returned it (rounded
    # once, as on one GPU), and the float32 accumulator covers only the rows later steps merge
    # into: under a window of W < L tokens the first W rows, not all L (at 64K tokens and 32
    # heads that is GiBs less memory traffic).
    # One varlen launch per step (and window) where the kernel has one (dtcp/exec/fused.py); its
    # results merge into float32 accumulators. Where the local step's first launch covers every
    # row, it writes straight into the call's out and lse (`direct`), and the later launches land
    # their rows run by run (exec/fused.py Landing): a row one of them reaches merges into the
    # result itself, a row several reach goes through the float32 accumulator only between the
    # first (which reads the result) and the last (which writes it). Each gives the bits a float32
    # accumulator over every row would: the values round once, where they are written. Where a
    # launch's rows are gathered (a kernel without varlen gaps), the hull of the later rows goes
    # through float32 instead: copied in after the first launch, back at the end. On a Balanced
    # rank most rows are documents held whole, which one launch finishes (no copy at all for them,
    # where the accumulator moved 12 bytes an element; 0 where the pass is one launch).
    fused = fused_steps(plan, kernel, q.device)
    keep_local = sink is None and plan.local_calls_disjoint and fused is None
    merged = plan.merged_rows if keep_local else (0, local_len)
    direct = sink is None and fused is not None and fills_rows(fused[0], local_len)
    # Where the local step writes the results (its first launch covers every row, or its disjoint
    # tasks are kept), the later launches' (tasks') outputs are kept whole in slots where they fit
    # (exec/fused.py Slots) and merged into the results once at the end: no float32 accumulator
    # between them. Else their rows run by run into the result or the accumulator (exec/fused.py
    # Landing: a row that one of them reaches never goes through float32), else the hull.
    heads, lse_bytes = q.shape[1], torch.finfo(acc).bits // 8

    def fits(n: int) -> bool:
        return q.shape[0] * n * heads * (v.shape[-1] * q.element_size() + lse_bytes) <= config.merge_slots_bytes
    slots = pass_slots(fused, q.device, fits) if direct else \
        task_slots(plan, q.device, fits) if keep_local and plan.steps[0].tasks else None
    land = landing(fused, takes_gaps(kernel)) if direct and slots is None else None
    later = land.seed if land is not None else (0, 0) if direct else (0, local_len)

    def no_keys_lse() -> torch.Tensor:  # lse of rows that have seen no key yet
        return torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)

    out = out_acc = lse_acc = q_rows = None
    if keep_local and not plan.steps[0].tasks:  # every local row is padding
        out, lse_acc = torch.zeros(out_shape, dtype=q.dtype, device=q.device), no_keys_lse()
    if direct:  # (rows outside `later` are never read or written here: no fill)
        out, out_acc = direct_results(out_shape, q.dtype, acc, q.device, land.acc if land is not None else (0, 0))
        lse_acc = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    if slots is not None:
        slots_out = torch.empty((q.shape[0], slots.rows, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        slots_lse = torch.empty((q.shape[0] * heads * slots.rows,), dtype=acc, device=q.device)

    for t, step in enumerate(plan.steps):
        works = None
        if t < plan.num_rounds:
            works, nxt = _send_next_block(comm, fit, plan, t, cur, local, spare)
        if not moves:
            cur = tuple(_rows(x, *step.span) for x in local)
        if fused is not None:
            fill = out_acc is None and fills_rows(fused[t], local_len)  # (with a sink: out_acc covers every row)
            if out_acc is None:
                out_acc = torch.empty(out_shape, dtype=acc, device=q.device) if fill else \
                    torch.zeros(out_shape, dtype=acc, device=q.device)
                lse_acc = torch.empty(q.shape[:-1], dtype=acc, device=q.device) if fill else no_keys_lse()
            if q_rows is None:  # rows-form views of what stays put, once per call (host time)
                q_rows, out_rows = [rows(q, b) for b in range(q.shape[0])], [rows(out_acc, b) for b in range(q.shape[0])]
            for b in range(q.shape[0]):
                q_b, out_b, k_b, v_b = q_rows[b], out_rows[b], rows(cur[0], b), rows(cur[1], b)
                for i, li in enumerate(fused[t]):
                    if direct and t == 0 and i == 0:
                        final = rows(out, b)
                        launch_forward(kernel, q_b, k_b, v_b, li, scale, softcap, into=(final, lse_acc[b]))
                        seed_later_(out_b, final, later)  # the rows later launches merge into, in float32
                        continue
                    if slots is not None:  # kept whole, merged at the end
                        at = slots.at[t, i]
                        launch_forward(kernel, q_b, k_b, v_b, li, scale, softcap,
                                       into=(slot_rows(slots_out, b, at), slot_lse(slots_lse, at, q.shape[0], heads)[b]))
                        continue
                    o, l = launch_forward(kernel, q_b, k_b, v_b, li, scale, softcap)
                    if fill and i == 0:
                        out_b.copy_(o)
                        lse_acc[b].copy_(l)
                    elif direct:
                        merge_launch_(out_b, lse_acc[b], li, o, l, rows(out, b), land)
                    else:
                        merge_launch_(out_b, lse_acc[b], li, o, l)
        for j, task in enumerate(step.tasks if fused is None else ()):
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            if t > 0 and slots is not None:  # kept whole, merged at the end
                at = slots.at[t, j]
                into = (slot_rows(slots_out, slice(None), at).transpose(1, 2), slot_lse(slots_lse, at, q.shape[0], heads))
                landed(kernel.forward_into(q[qs], cur[0][ks], cur[1][ks], task.lo, task.hi, scale, *into,
                                           softcap=softcap), into)
                continue
            o, l = kernel.forward(q[qs], cur[0][ks], cur[1][ks], task.lo, task.hi, scale, softcap=softcap)
            if t == 0 and keep_local:
                whole = _covers_all_rows(step, local_len)
                if out is None:  # contiguous, as the op's fake promises
                    out = _whole_or_zeros(o, out_shape, q.dtype, whole)
                    lse_acc = l.to(acc).contiguous() if whole else no_keys_lse()
                if not whole:
                    out[qs] = o
                    lse_acc[qs] = l
                continue
            if out_acc is None and keep_local:
                out_acc = _rows(out, *merged).to(acc)  # (the rows themselves for float64)
            if out_acc is None and _covers_all_rows(step, local_len):
                # First result covering every row: it *is* the running result (no merge needed).
                out_acc = torch.empty(out_shape, dtype=acc, device=q.device).copy_(o)
                lse_acc = l.to(acc).contiguous()
                continue
            if out_acc is None:
                out_acc, lse_acc = torch.zeros(out_shape, dtype=acc, device=q.device), no_keys_lse()
            merge_into_(_rows(out_acc, task.q_start, task.q_end, merged[0]), lse_acc[qs], o, l)
        if works is not None:
            comm.wait(works)
            cur = nxt
    if slots is not None:
        merge_slots_(out, lse_acc, slots_out, slots_lse, slots.spans, slots.table)
    if out_acc is None and not keep_local:  # no task at all: every row is padding
        out_acc, lse_acc = torch.zeros(out_shape, dtype=acc, device=q.device), no_keys_lse()
    comm.finish()
    if sink is not None:
        apply_sink_(out_acc, lse_acc, sink)
    # A row that no task touched sees no key at all (padding under a document mask): its out
    # stays 0; give it a finite lse (0, as PyTorch's CPU flash kernel does) instead of -inf.
    lse_acc.masked_fill_(torch.isneginf(lse_acc), 0.0)
    if direct:
        return finish_results(out, out_acc, later), lse_acc
    if not keep_local:
        return out_acc.to(q.dtype), lse_acc
    if out_acc is not None:
        _rows(out, *merged).copy_(out_acc)
    return out, lse_acc


def _fills_block(block_grads, span_len: int, batch: int) -> bool:
    """Is a step's dK/dV one launch per batch row over every key of the held span, in order?"""
    return (all(b is not None and not where.gapped and where.span == (0, span_len) for b, where, _, _ in block_grads)
            and sorted(b for b, _, _, _ in block_grads) == list(range(batch)))


def _fitter(comm):
    """comm.fit for one ring call, each (slots, slot, shapes) fitted once: a step's receive views
    repeat every other step (one slot, one span length), and making them is host time."""
    fitted: dict = {}

    def fit(slots, i: int, shapes, kind: str, dtype=None):
        key = (kind, i, tuple(shapes), dtype)
        views = fitted.get(key)
        if views is None:
            # (`dtype`: the slot's bytes read as another dtype, e.g. bf16 in a float32 slot)
            slot = slots[i] if dtype is None else [t.view(dtype) for t in slots[i]]
            views = fitted[key] = comm.fit(slot, shapes, kind)
        return views
    return fit


def _send_next_block(comm, fit, plan: RingPlan, t: int, cur, local, spare):
    """Start the K/V transfer for step t + 1: forward the span held (a chain's span is the same
    at every hop), or at the start of a chain this rank's own block's span. Returns (what
    comm.wait takes, the receive views: step t + 1's span of the next block)."""
    nxt_step = plan.steps[t + 1]
    send = [_rows(x, *nxt_step.home_span) for x in local] if plan.starts_chain(t + 1) else list(cur)
    nxt = fit(spare, t % 2, _shapes(local, nxt_step.span_len), "kv")
    return comm.exchange(send, nxt, nxt_step.shift, "kv", t % 2), nxt


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: Kernel, scale: float, comm, softcap=None,
                  kv_dtype=None):
    """Gradients of ring_forward, given its final out and lse (with the sink, if any: then every
    kernel's probabilities are the final ones, and dq, dk, dv need nothing else). Returns dq, dk,
    dv in the input dtypes, or dk and dv in `kv_dtype` (fused.py finish_gradients)."""
    acc = acc_dtype(q.dtype)
    rounds, local_len = plan.num_rounds, q.shape[2]
    local = cur = (k.contiguous(), v.contiguous())
    spare = comm.spare_buffers(_slot_like(local, plan), "kv") if rounds else []
    fit = _fitter(comm)
    moves = not isinstance(comm, NoComm)  # NoComm: every step reuses the rank's own block
    # As in the forward: with disjoint local calls, their dq (dK/dV) stand as the kernel
    # returned them except on the rows (keys) other steps add to, which sum in float32.
    fused = fused_steps(plan, kernel, q.device)
    keep_local = plan.local_calls_disjoint and fused is None
    # The later launches' (tasks') dQ kept whole in slots where they fit, summed into the result
    # once at the end (as the forward's outputs, exec/fused.py Slots), in the dtype the kernel
    # returns them in (not rounded again).
    dq_kept = kernel.grad_dtype(q.dtype)

    def fits(n: int) -> bool:
        return q.shape[0] * n * q.shape[1] * q.shape[3] * dq_kept.itemsize <= config.merge_slots_bytes
    slots = dq_slots = None
    if keep_local:
        dq_rows = plan.merged_rows
        home_keys = plan.returned_keys if moves else (0, 0)  # (NoComm: nothing comes home)
        grads = dq_acc = own_dkv = None
        slots = task_slots(plan, q.device, fits) if plan.steps[0].tasks else None
        if not plan.steps[0].tasks:
            grads = tuple(torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    else:
        dq_rows, home_keys = (0, local_len), (0, local_len)
        # As in the forward: where the local step's first launch covers every row (every key of
        # the rank's block), it writes dQ (dK/dV) straight into the results, and only the rows
        # (keys) more launches or the chains' returns add to (later_rows / later_keys, hulls) go
        # through a float32 accumulator: copied in after that launch, back at the end. A row that
        # one launch finishes keeps that launch's gradient, what a float32 round trip gives back.
        fill_q = fused is not None and fills_rows(fused[0], local_len)
        fill_kv = fused is not None and fills_keys(fused[0], k.shape[2])
        launches = launches_of(fused) if fill_q or fill_kv else None
        # (as the forward's rows: slots where they fit, else landed by role)
        slots = pass_slots(fused, q.device, fits) if fill_q else None
        land_q = landing(fused, takes_gaps(kernel)) if fill_q and slots is None else None
        later_q = land_q.seed if land_q is not None else (0, 0)
        # (the returned keys count with NoComm too, which adds nothing: the copies are timed as a ring's)
        later_kv = later_keys(launches, plan.returned_keys) if fill_kv else (0, 0)

        dq_out, dq_acc = gradient_results(q, acc, fill_q, land_q.acc if land_q is not None else (0, 0))

        # Gradients of this rank's own K/V: its own share plus what comes home at the chains' ends.
        (dk_out, dk_acc), (dv_out, dv_acc) = (gradient_results(x, acc, fill_kv, later_kv) for x in (k, v))
        own_dkv = (dk_acc, dv_acc)
    if slots is not None:
        dq_slots = torch.empty((q.shape[0], slots.rows) + q.shape[1:2] + q.shape[3:], dtype=dq_kept, device=q.device)
    dkv_bufs = comm.spare_buffers(_slot_like(local, plan), "grad", acc) if rounds else []
    dkv_works = fixed_rows = None
    # A chain of one hop (Step.one_share) sends home one kernel share per key: in the dtype the
    # kernel returned it in, half the bytes of float32 under bf16 (the same values).
    share_dtype = kernel.grad_dtype(q.dtype)
    share_dtype = None if share_dtype.itemsize >= acc.itemsize else share_dtype

    def grad_slot(i: int, span_len: int, one_share: bool = False) -> list[torch.Tensor]:
        return fit(dkv_bufs, i, _shapes(local, span_len), "grad", share_dtype if one_share else None)

    for t, step in enumerate(plan.steps):
        kv_works = None
        if t < rounds:
            kv_works, nxt = _send_next_block(comm, fit, plan, t, cur, local, spare)
        if not moves:
            cur = tuple(_rows(x, *step.span) for x in local)
        block_grads = []  # this step's dK/dV for the span held: (batch row or None, keys, dk, dv) per call
        if fused is not None:
            if fixed_rows is None:  # rows-form views of what stays put, once per call (host time)
                fixed_rows = [[rows(x, b) for x in (dout, q, out, dq_acc)] for b in range(q.shape[0])]
            for b in range(q.shape[0]):
                k_b, v_b = rows(cur[0], b), rows(cur[1], b)
                for i, li in enumerate(fused[t]):
                    first = t == 0 and i == 0
                    grads = backward_launch_(kernel, fixed_rows[b], k_b, v_b, lse[b], li, scale, softcap, b,
                                             into_q=dq_out if first and fill_q else None,
                                             into_kv=(dk_out, dv_out) if first and fill_kv else None,
                                             later_q=later_q, dkv_acc=(dk_acc, dv_acc), later_kv=later_kv,
                                             dq_result=dq_out, land_q=land_q,
                                             dq_slot=None if first or dq_slots is None else
                                             slot_rows(dq_slots, b, slots.at[t, i]))
                    if grads is not None:
                        block_grads.append((b, li.k) + grads)
                    del grads
        for j, task in enumerate(step.tasks if fused is None else ()):
            qs, ks = seq_slice(task.q_start, task.q_end), _task_keys(task, step)
            if t > 0 and slots is not None:  # its dQ kept whole, summed at the end
                into = slot_rows(dq_slots, slice(None), slots.at[t, j]).transpose(1, 2)
                got = kernel.backward_into(dout[qs], q[qs], cur[0][ks], cur[1][ks], out[qs], lse[qs], task.lo, task.hi,
                                           scale, into, softcap=softcap)
                _, dk_t, dv_t = landed(got, (into, None, None))
                block_grads.append((None, ks, dk_t, dv_t))
                del dk_t, dv_t
                continue
            dq_t, dk_t, dv_t = kernel.backward(
                dout[qs], q[qs], cur[0][ks], cur[1][ks], out[qs], lse[qs], task.lo, task.hi, scale, softcap=softcap
            )
            if t == 0 and keep_local:
                whole = (task.q_start, task.q_end, task.k_start, task.k_end) == (0, local_len, 0, k.shape[2])
                if grads is None:
                    grads = tuple(_whole_or_zeros(g, x.shape, x.dtype, whole)
                                  for g, x in zip((dq_t, dk_t, dv_t), (q, k, v)))
                if not whole:
                    grads[0][qs] = dq_t
                    grads[1][ks] = dk_t
                    grads[2][ks] = dv_t
                continue
            _rows(dq_acc, task.q_start, task.q_end, dq_rows[0]).add_(dq_t)
            block_grads.append((None, ks, dk_t, dv_t))
            del dq_t, dk_t, dv_t
        if t == 0 and keep_local:
            # the local calls are all in: float32 only for the rows and keys others add to
            if slots is None:  # (kept: dQ is summed into the result at the end)
                dq_acc = _rows(grads[0], *dq_rows).to(acc)  # (the rows themselves for float64)
            own_dkv = tuple(_rows(g, *home_keys).to(acc) for g in grads[1:])
        if t == 0:
            travelling = own_dkv  # the own block's gradients never leave
        else:
            travelling = grad_slot(t % 2, step.span_len, step.one_share)  # the held span's dK/dV accumulator
            # (NoComm stands in for a received accumulator with whatever its slot holds: the
            # benchmarks time what a ring rank does, which fills only where a chain starts.)
            if plan.starts_chain(t):
                comm.drain()  # the buffer may still be being sent from
                if _fills_block(block_grads, step.span_len, q.shape[0]):
                    # One launch per batch row took every key of the span: its dK/dV *are* the
                    # accumulator's start (a copy, not a zero fill and an add; the same values).
                    for b, _, dk_t, dv_t in block_grads:
                        rows(travelling[0], b).copy_(dk_t)
                        rows(travelling[1], b).copy_(dv_t)
                    block_grads = []
                else:
                    travelling[0].zero_()
                    travelling[1].zero_()
            elif moves:
                comm.wait(dkv_works)  # this block's accumulator has arrived from its previous holder
            dkv_works = None
        for b, where, dk_t, dv_t in block_grads:
            if b is None:  # a task's keys (a slice)
                travelling[0][where].add_(dk_t)
                travelling[1][where].add_(dv_t)
            else:  # a launch's keys (rows form; a key two of its sequences share gets both shares)
                add_rows_(rows(travelling[0], b), where, dk_t)
                add_rows_(rows(travelling[1], b), where, dv_t)
        del block_grads
        if t > 0 and moves:
            if t not in plan.chain_ends:
                # Pass it on to the block's next holder; it arrives while that rank computes. We
                # receive the accumulator of the block we hold next.
                incoming = grad_slot((t + 1) % 2, plan.steps[t + 1].span_len)
                dkv_works = comm.exchange(list(travelling), incoming, step.shift, "grad", (t + 1) % 2)
            else:
                # End of a chain: send it to the block's owner and take in ours (our block's span
                # in this chain). The other dK/dV slot is free here (its last send was waited on
                # in this step).
                returned = grad_slot((t + 1) % 2, step.home_span[1] - step.home_span[0], step.one_share)
                # (src - rank is the same for every rank modulo N, so all take the same path.)
                comm.wait(comm.exchange(list(travelling), returned, step.src - plan.rank, "grad", (t + 1) % 2))
                for mine, back in zip(own_dkv, returned):
                    _rows(mine, *step.home_span, home_keys[0]).add_(back)
        if kv_works is not None:
            comm.wait(kv_works)
            cur = nxt
    comm.finish()
    if not keep_local and dq_slots is not None:
        sum_slots_(dq_out, dq_slots, slots.spans, slots.table, acc)
    if not keep_local:
        return finish_gradients(((dq_out, dq_acc, later_q, q), (dk_out, dk_acc, later_kv, k),
                                 (dv_out, dv_acc, later_kv, v)), kv_dtype)
    if slots is not None:
        sum_slots_(grads[0], dq_slots, slots.spans, slots.table, acc)
    else:
        _rows(grads[0], *dq_rows).copy_(dq_acc)
    if kv_dtype is not None:  # (the local calls' own results widened exactly; the sums below unrounded)
        grads = (grads[0],) + tuple(g.to(kv_dtype) for g in grads[1:])
    for g, summed in zip(grads[1:], own_dkv):
        _rows(g, *home_keys).copy_(summed)
    return grads
