"""Running a ring step's launches (dtcp/plan/fuse.py): gathers, one varlen call, merges.

Tensors here are in *rows* form, one batch row at a time: (L, H, D) views of the ring's
(B, H, L, D) tensors (x[b].transpose(0, 1): no copy; FlashAttention-4 and flash take such
strides). A launch's query rows and keys are a view where they tile one range in order, else
one copy of each of its ranges (few ranges; an index_select beyond `MAX_RANGES`). Its output
lands on float32 accumulators, (B, L, H, Dv) and lse (B, H, L), with one merge per launch (a
slice; a window with a row mask where the kernel read rows lying apart in place; or
gather/merge/scatter when the rows are scattered); dK/dV are added the same way (gathered: range
by range, a key two sequences share getting both shares, in a fixed order). Where a pass's first
launch writes the results itself, the later launches' merges and dQ adds go by each row's role
(`Landing`): straight into the result for a row one of them reaches, through float32 only
between the first and the last of several, in one launch each (exec/merge.py land_merge_).

Why ranges and not index tensors: rows form is a transposed view, and an index_select or
index_add_ along its first dim runs a strided gather/scatter kernel; on one H100, for a 64K-token
rank, those took 15 of a pass's 25 ms (FA4's own kernels 9 ms; bench_split --profile, issue 23).
A copy per range is a plain strided copy, at memory speed.

Index tensors and cumulative lengths are built once per plan and device and cached with the
plan object (plans are cached by value, so a new document structure is a new plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import config
from ..kernels import Kernel, VarlenSeqs
from ..kernels.base import int32_rows, landed
from ..plan import RingPlan
from ..plan.fuse import FIRST, LAST, MID, ONLY, Launch, accumulator_hull, fused_launches, later_rows, row_runs
from .allgather import bounded_put
from .merge import MASKED_RANGES, NONE_ROLE, can_land_in_one_launch, land_add_, land_merge_, merge_into_


@dataclass(frozen=True)
class Where:
    """Where a launch's rows (or keys) are in a rank's tensor: `span` (start, end) read as one
    slice, when they tile it (`gapped` False) or lie in it apart, in order (`gapped`: a window;
    the launch's tensor then has the window's length, the rows between undefined); else
    `ranges` gathered (`index`, the same rows as an index tensor, for many ranges)."""

    span: Optional[tuple[int, int]]
    index: Optional[torch.Tensor]
    ranges: tuple
    gapped: bool = False
    # gapped, over more than MASKED_RANGES ranges: (span length,) bool on the device, True on the
    # rows of `ranges`. Merges and adds then run once over the whole window with it (the kernel
    # leaves the rows between unwritten: any value, NaN included) instead of once per range: a
    # DocZigzag step's launch holds ~100 ranges, and per-range merges made its ring host-bound
    # (14,000 tensor ops a pass at N = 8 on a long-tailed mix; 118 ms against 45 ms on H100).
    # With few ranges, range by range moves less memory (a window can be the rank's whole length).
    used: Optional[torch.Tensor] = None

    @property
    def one_slice(self) -> bool:
        """Do merges and adds run once over `span` (the rows tile it, or a row mask marks them)?"""
        return self.span is not None and (not self.gapped or self.used is not None)


@dataclass(frozen=True)
class LaunchIndex:
    """A launch with what its calls need on the device: where its query rows (`q`) and keys
    (`k`) are taken from (a slice where they tile a range; a window where they lie apart in order
    and the kernel takes varlen gaps; else an index tensor to gather with) and the varlen
    cumulative lengths."""

    launch: Launch
    q: Where
    k: Where
    seqs: VarlenSeqs


_FUSED: dict = {}


def fuses(kernel: Kernel) -> bool:
    """Does the ring run its steps as varlen launches with this kernel (exec, and the cost model's count)?"""
    return kernel.varlen_one_launch and config.ring_one_launch


def takes_gaps(kernel: Kernel) -> bool:
    """... and read rows and keys that lie apart, in order, in place (VarlenSeqs.used_q)?"""
    return kernel.varlen_gaps and config.varlen_gaps


def fused_steps(plan: RingPlan, kernel: Kernel, device: torch.device,
                direct: bool = False) -> Optional[tuple[tuple[LaunchIndex, ...], ...]]:
    """Each step's launches for `kernel`, or None where the plan runs task by task: the kernel
    has no one-launch varlen form, the setting is off, fusing saves no launch, or the kernel
    refuses a launch. Keys count from the held span's start, or with `direct` from the direct
    span's (Step.direct_span: what the ring in groups receives)."""
    if not fuses(kernel):
        return None
    gaps = takes_gaps(kernel)
    key = (id(plan), kernel.name, device, gaps, direct)
    hit = _FUSED.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    steps = fused_launches(plan, kernel.reject_varlen_reason)
    fused = None
    if steps is not None:  # keys counted from the start of what is held
        fused = tuple(tuple(_indexed(_from(launch, (step.direct_span if direct else step.span)[0]), device, gaps)
                            for launch in launches) for step, launches in zip(plan.steps, steps))
    bounded_put(_FUSED, key, (plan, fused))
    return fused


def _from(launch: Launch, origin: int) -> Launch:
    return Launch(launch.window, launch.q_ranges, tuple((a - origin, b - origin) for a, b in launch.k_ranges))


def _indexed(launch: Launch, device, gaps: bool = False) -> LaunchIndex:
    def index(ranges, span):
        if span is not None:
            return None
        return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)

    def side(ranges, span, packed, in_order):  # (Where, cu, used or None)
        if span is None and gaps and in_order:
            w0, w1 = ranges[0][0], ranges[-1][1]
            used = None
            if len(ranges) > MASKED_RANGES:
                used = torch.zeros(w1 - w0, dtype=torch.bool)
                for a, b in ranges:
                    used[a - w0:b - w0] = True
                used = used.to(device)
            return (Where((w0, w1), None, ranges, True, used), tuple(a - w0 for a, _ in ranges) + (w1 - w0,),
                    tuple(b - a for a, b in ranges))
        return Where(span, index(ranges, span), ranges), packed, None

    q_at, cu_q, used_q = side(launch.q_ranges, launch.q_span, launch.cu_q, launch.q_in_order)
    k_at, cu_k, used_k = side(launch.k_ranges, launch.k_span, launch.cu_k, launch.k_in_order)
    on_device = iter(int32_rows([cu_q, cu_k] + [u for u in (used_q, used_k) if u is not None], device))
    cu_q_t, cu_k_t = next(on_device), next(on_device)
    used = [None if u is None else next(on_device) for u in (used_q, used_k)]
    lens = launch.seq_lens
    seqs = VarlenSeqs(cu_q, cu_k, cu_q_t, cu_k_t, max(q for q, _ in lens), max(k for _, k in lens),
                      used_q, used_k, used[0], used[1])
    return LaunchIndex(launch, q_at, k_at, seqs)


def fills_rows(launches, local_len: int) -> bool:
    """Does a step's first launch cover every query row of the rank, in order (its output then
    stands for the whole accumulator)?"""
    return bool(launches) and launches[0].launch.q_span == (0, local_len)


def launches_of(fused) -> tuple[tuple[Launch, ...], ...]:
    """Each step's launches as the plan has them (keys counted from the held span's start), for
    plan/fuse.py's later_rows and later_keys."""
    return tuple(tuple(li.launch for li in step) for step in fused)


def fills_keys(launches, kv_len: int) -> bool:
    """Does a step's first launch take every key of the block, in order, each once?"""
    return bool(launches) and launches[0].launch.k_span == (0, kv_len)


@dataclass(frozen=True)
class Landing:
    """Where a pass's launches after its first land on the query rows, forward (merges of out and
    lse) and backward (adds of dQ), where the first launch writes the results itself:

      seed   the hull that goes through float32 as a whole: copied in after the first launch
             (seed_later_), back at the end (finish_results); (0, 0) where the runs route
      runs   {id(LaunchIndex): its rows' runs (start, end, role)} (plan/fuse.py row_runs), or None
             (every later launch lands on the accumulator, over the hull `seed`)
      acc    the rows the float32 accumulator serves (its size: direct_results)"""

    seed: tuple[int, int]
    runs: Optional[dict]
    acc: tuple[int, int]
    first: int = 0  # id of the pass's first launch (which has no runs: it writes the results)
    # {id(LaunchIndex): (window length,) int8 on the device: each row's role, NONE_ROLE between
    # the launch's rows}, made on first use (once per plan: landings are cached with the launches)
    roles: dict = field(default_factory=dict, compare=False, repr=False)

    def of(self, li: "LaunchIndex"):
        """The runs of a later launch (None: onto the accumulator; the first launch: None)."""
        if self.runs is None or id(li) == self.first:
            return None
        return self.runs[id(li)]  # (a launch of another pass: KeyError, never a silent hull)

    def roles_of(self, li: "LaunchIndex", device) -> torch.Tensor:
        """A later launch's runs as one role per row of its window (li.q.span), for the one-launch
        merge and add (exec/merge.py land_merge_ / land_add_)."""
        got = self.roles.get(id(li))
        if got is None:
            w0, w1 = li.q.span
            got = torch.full((w1 - w0,), NONE_ROLE, dtype=torch.int8)
            for a, b, role in self.of(li):
                got[a - w0:b - w0] = role
            got = self.roles[id(li)] = got.to(device)
        return got


_LANDINGS: dict = {}


def landing(passes: tuple, gaps: bool) -> Landing:
    """The Landing of a pass whose launches run in the order of `passes` (a tuple of launch sites,
    each a tuple of LaunchIndex; its first launch writes the results). Cached with the launches
    (held by the plan's cached fused steps), so a pass computes it once per plan, not per call.
    Keyed by the launches themselves, not by the tuples holding them: a caller may build `passes`
    anew every call (the grouped ring does), and a Landing made anew would copy its row roles to
    the device again at every launch (a copy from host memory that waits for the stream: on one
    H100 the grouped ring's host time was 78 ms a forward where it queued 1 ms of work)."""
    order = [li for site in passes for li in site]
    key = tuple(tuple(map(id, site)) for site in passes)
    hit = _LANDINGS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], order)):
        return hit[1]
    runs = row_runs(tuple(li.launch for li in order), gaps)
    if runs is None or any(li.q.span is None for li in order[1:]):
        later = later_rows(tuple(tuple(li.launch for li in site) for site in passes))
        got = Landing(later, None, later)
    else:
        got = Landing((0, 0), {id(li): r for li, r in zip(order[1:], runs)}, accumulator_hull(runs), id(order[0]))
    bounded_put(_LANDINGS, key, (tuple(order), got))
    return got


@dataclass(frozen=True)
class Slots:
    """Where a pass's later launches (all but its first, which writes the results) keep their
    outputs whole, to merge (forward) or sum (backward dQ) once at the end (exec/merge.py
    merge_slots_ / sum_slots_) instead of launch by launch.

    Why: a launch-by-launch merge reads and writes a float32 accumulator over the launch's rows
    (10 bytes an element per launch for bf16), where a launch's kept output is 2 bytes written
    (by the kernel itself, into its slot) and 2 read once. On a short pass this was most of
    dtcp's own device time: causal 32K over 8 ranks, about 1.1 ms of a rank's 7.7 ms in dQ adds,
    merges and copies (one H200; 0.46 ms left with slots: docs/performance-log.md).

      spans   (a, e, o, base, T) per range of a later launch's query rows, in launch order:
              the launch's output (T rows: its one range, or the window of rows that lie apart,
              as the kernel writes them) is slot rows base..base + T, and its rows [a, e) are
              slot rows o.. (exec/merge.py merge_slots_)
      at      {(step, launch or task index in the step): (base, T)}, its output's slot rows
              (by position: one object may stand in two steps)
      rows    the slots' length in rows
      table   the spans as a (C, 5) int32 tensor on the device, for the Triton kernels

    A launch whose rows lie apart (a Balanced rank's high chunks of several cut documents, which
    a later rank's low chunks reach) is kept too: one span per range, read in place from the
    window the kernel wrote (the rows between are never read)."""

    spans: tuple
    at: dict
    rows: int
    table: torch.Tensor


_SLOTS: dict = {}


#: the most spans (ranges of later launches' rows) a pass keeps in slots: the merge visits every
#: span for each tile of rows, so a pass of many scattered ranges (DocZigzag: ~100 a launch)
#: merges launch by launch instead
MAX_SLOT_SPANS = 64


def slots_of(passes: tuple, device) -> Optional[Slots]:
    """The Slots of a pass whose launches run in the order of `passes` (its first launch writes
    the results), or None where a later launch's rows are gathered (not one range, nor apart in
    order in a window) or its later launches' rows come in more than MAX_SLOT_SPANS ranges: those
    merge launch by launch. Cached with the launches, as `landing` is."""
    order = [li for site in passes for li in site]
    key = (tuple(tuple(map(id, site)) for site in passes), device)
    hit = _SLOTS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], order)):
        return hit[1]
    got = None
    # (rows gathered into a packed launch, for a kernel that cannot read them apart in place, merge
    # launch by launch: their merge reads the gathered rows in one piece, which slots would split)
    if all(li.q.span is not None for li in order[1:]) and \
            sum(len(li.q.ranges) for li in order[1:]) <= MAX_SLOT_SPANS:  # (the first writes the results)
        got = _slots([((t, i), _output_rows(li.q), _slot_pieces(li.q))
                      for t, site in enumerate(passes) for i, li in enumerate(site)][1:], device)
    bounded_put(_SLOTS, key, (tuple(order), got))
    return got


def _slot_pieces(where: Where) -> tuple:
    """A launch's rows as (a, e, c): rows [a, e) at rows c.. of its output. One piece where they
    tile one range; one a range where they lie apart (at their offsets in the window)."""
    if not where.gapped:
        return ((where.span[0], where.span[1], 0),)
    return tuple((a, b, c) for a, b, c, _ in _pieces(where))


def _output_rows(where: Where) -> int:
    """The rows of a launch's output (its rows in one range, or the window of rows that lie apart)."""
    return where.span[1] - where.span[0]


def _slots(blocks, device) -> Slots:
    """The Slots of later blocks given as ((step, index in the step), T, ((a, e, c), ...)) in
    launch order: a block's output has T rows, its query rows [a, e) at rows c.. of it."""
    spans, at, base = [], {}, 0
    for where, t, pieces in blocks:
        at[where] = (base, t)
        spans += [(a, e, base + c, base, t) for a, e, c in pieces]
        base += t
    return Slots(tuple(spans), at, base, torch.tensor(spans, dtype=torch.int32).reshape(-1, 5).to(device))


def pass_slots(passes: tuple, device, fits) -> Optional[Slots]:
    """slots_of where a pass keeps its later launches whole: the setting is on (config
    merge_slots_bytes > 0), there are later launches, in at most MAX_SLOT_SPANS ranges, and
    `fits(rows)` says the slots' bytes are within the setting."""
    if config.merge_slots_bytes <= 0 or sum(len(site) for site in passes) < 2:
        return None
    slots = slots_of(passes, device)
    return slots if slots is not None and fits(slots.rows) else None


def slot_rows(slots_x: torch.Tensor, b: int, where: tuple) -> torch.Tensor:
    """A launch's output rows (Slots.at: (base, T)) of batch row b of a (B, R, H, D) slots
    tensor, (T, H, D) contiguous (b = slice(None): a task's, every batch row, (B, T, H, D))."""
    base, t = where
    return slots_x[b, base:base + t]


def slot_lse(slots_lse: torch.Tensor, where: tuple, batch: int, heads: int) -> torch.Tensor:
    """A launch's (B, H, T) lse block (Slots.at: (base, T)) of a (B * H * R,) slots lse, contiguous."""
    base, t = where
    return slots_lse[batch * heads * base:batch * heads * (base + t)].view(batch, heads, t)


_TASK_SLOTS: dict = {}


def task_slots(plan: RingPlan, device, fits) -> Optional[Slots]:
    """The Slots of a ring pass run task by task whose local step writes the results: each task
    after the local step, in order (a task's rows are one range), where the setting is on, there
    are such tasks and `fits(rows)` (as pass_slots). Cached with the plan."""
    if config.merge_slots_bytes <= 0 or not any(step.tasks for step in plan.steps[1:]):
        return None
    got = _task_slots(plan, device)
    return got if fits(got.rows) else None


def _task_slots(plan: RingPlan, device) -> Slots:
    key = (id(plan), device)
    hit = _TASK_SLOTS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    got = _slots([((t, j), task.q_end - task.q_start, ((task.q_start, task.q_end, 0),))
                  for t, step in enumerate(plan.steps) if t for j, task in enumerate(step.tasks)], device)
    bounded_put(_TASK_SLOTS, key, (plan, got))
    return got


def direct_results(shape, dtype, acc, device, later: tuple[int, int]):
    """(result, accumulator) of a pass whose first launch writes `result` (B, H, L, D) itself:
    the accumulator (float32; float64 for float64) serves only the rows (keys) `later`, a hull,
    that more launches merge or add into (copied in after the first launch, back by
    `finish_results`); it is the result itself where there are none or `dtype` is `acc`."""
    result = torch.empty(shape, dtype=dtype, device=device)
    if dtype == acc or later[0] >= later[1]:
        return result, result
    return result, torch.empty(shape, dtype=acc, device=device)


def gradient_results(like: torch.Tensor, acc, fill: bool, later: tuple[int, int]):
    """(result or None, accumulator) of a gradient shaped like `like`: direct_results where the
    first launch writes it (`fill`), else (None, zeros in `acc` over everything)."""
    if not fill:
        return None, torch.zeros(like.shape, dtype=acc, device=like.device)
    return direct_results(like.shape, like.dtype, acc, like.device, later)


def seed_later_(acc_rows: torch.Tensor, result_rows: torch.Tensor, later: tuple[int, int]) -> None:
    """After the first launch: its result on the rows `later`, into the accumulator (rows form)."""
    if acc_rows.data_ptr() != result_rows.data_ptr():
        acc_rows[later[0]:later[1]].copy_(result_rows[later[0]:later[1]])


def finish_results(result: torch.Tensor, summed: torch.Tensor, later: tuple[int, int]) -> torch.Tensor:
    """`result` with the rows `later` of its accumulator `summed` copied back (direct_results)."""
    if summed is not result:
        result[:, :, later[0]:later[1]].copy_(summed[:, :, later[0]:later[1]])
    return result


def finish_gradients(grads, kv_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, ...]:
    """The backward's dq, dk, dv from (result or None, accumulator, later, like) each, as
    gradient_results made them: the result with its rows `later` copied back (finish_results),
    or, without one, the accumulator cast to like's dtype. `kv_dtype`: dk and dv in this dtype
    instead (float32 under half inputs: the sums not rounded, the first launch's own results
    widened exactly), for a caller that sums them again (exec/route.py `_heads_backward`)."""
    dtypes = (None, kv_dtype, kv_dtype)
    return tuple(summed.to(dtype or like.dtype) if result is None
                 else finish_results(result if dtype is None else result.to(dtype), summed, later)
                 for (result, summed, later, like), dtype in zip(grads, dtypes))


def rows(x: torch.Tensor, b: int) -> torch.Tensor:
    """Batch row b of a (B, H, L, D) tensor as (L, H, D), a view: x[b].transpose(0, 1) in one
    tensor op instead of two (called per step and tensor: host time on a host-bound ring)."""
    s = x.stride()
    return x.as_strided((x.shape[2], x.shape[1], x.shape[3]), (s[2], s[1], s[3]), x.storage_offset() + b * s[0])


#: a launch's rows or keys in at most this many ranges are copied range by range; more, one index_select
MAX_RANGES = 32


def _pick(x_rows: torch.Tensor, where: Where) -> torch.Tensor:
    """Rows of x_rows (L, ...) along dim 0: the slice `where.span` (a view), else its ranges copied."""
    if where.span is not None:
        return x_rows[where.span[0]:where.span[1]]
    if len(where.ranges) <= MAX_RANGES:
        return torch.cat([x_rows[a:b] for a, b in where.ranges])
    return x_rows.index_select(0, where.index)


def _pick_lse(lse_rows: torch.Tensor, where: Where) -> torch.Tensor:
    """Columns of a (H, L) lse: a slice, else the ranges, contiguous."""
    if where.span is not None:
        return lse_rows[:, where.span[0]:where.span[1]].contiguous()
    if len(where.ranges) <= MAX_RANGES:
        return torch.cat([lse_rows[:, a:b] for a, b in where.ranges], dim=1)
    return lse_rows.index_select(1, where.index)


def _put(x_rows: torch.Tensor, ranges, index, values: torch.Tensor, dim: int = 0) -> None:
    """x_rows[rows] = values along `dim` (rows: `ranges`, = `index`, distinct)."""
    if len(ranges) <= MAX_RANGES:
        off = 0
        for a, b in ranges:
            x_rows.narrow(dim, a, b - a).copy_(values.narrow(dim, off, b - a))
            off += b - a
        return
    x_rows.index_copy_(dim, index, values)


def _pieces(where: Where):
    """(rank rows [a, b), the launch tensor's rows [c, d)) of each range: at the window's offsets
    when gapped, else packed one after another."""
    off = 0
    for a, b in where.ranges:
        if where.gapped:
            yield a, b, a - where.span[0], b - where.span[0]
        else:
            yield a, b, off, off + b - a
            off += b - a


def launch_forward(kernel: Kernel, q_rows, k_rows, v_rows, li: LaunchIndex, scale, softcap, into=None):
    """One launch on one batch row: (out (T, H, Dv), lse (H, T) float32). k_rows/v_rows: the
    held span's keys (the launch counts keys from its start). into: (out, lse) to write them into."""
    q, k, v = _pick(q_rows, li.q), _pick(k_rows, li.k), _pick(v_rows, li.k)
    if into is None:
        return kernel.varlen_forward(q, k, v, li.seqs, li.launch.window, scale, softcap=softcap)
    got = kernel.varlen_forward_into(q, k, v, li.seqs, li.launch.window, scale, *into, softcap=softcap)
    return landed(got, into)


def merge_launch_(out_acc_rows: torch.Tensor, lse_acc: torch.Tensor, li: LaunchIndex, out, lse,
                  result_rows: Optional[torch.Tensor] = None, land: Optional[Landing] = None) -> None:
    """Fold a launch's (out (T, H, Dv), lse (H, T)) into one batch row's accumulators:
    out_acc_rows (L, H, Dv), lse_acc (H, L). `land` (where the pass's first launch wrote the
    results): where it routes this launch's rows (Landing.of), each is read from and written to
    the result (`result_rows`, (L, H, Dv)) or the accumulator by its role."""
    where = li.q
    blk_out, blk_lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)  # (1, H, T, Dv), (1, H, T)
    runs = None if land is None else land.of(li)
    if runs is not None:
        if can_land_in_one_launch(out_acc_rows, result_rows, blk_out, lse_acc):  # one launch, roles per row
            w0, w1 = where.span
            land_merge_(out_acc_rows[w0:w1].transpose(0, 1).unsqueeze(0),
                        result_rows[w0:w1].transpose(0, 1).unsqueeze(0), lse_acc[:, w0:w1].unsqueeze(0),
                        blk_out, blk_lse, land.roles_of(li, blk_out.device))
            return
        _merge_runs_(out_acc_rows, lse_acc, where, blk_out, blk_lse, result_rows, runs)
        return
    if where.one_slice:  # (with a row mask: the rows between hold nothing of this launch)
        a, b = where.span
        merge_into_(out_acc_rows[a:b].transpose(0, 1).unsqueeze(0), lse_acc[:, a:b].unsqueeze(0), blk_out, blk_lse,
                    rows_used=where.used)
        return
    if where.gapped:  # each range in place
        for a, b, c, d in _pieces(where):
            merge_into_(out_acc_rows[a:b].transpose(0, 1).unsqueeze(0), lse_acc[:, a:b].unsqueeze(0),
                        blk_out[:, :, c:d], blk_lse[:, :, c:d])
        return
    ranges = where.ranges  # (distinct rows: a launch's sequences never share a query row)
    acc_out = _pick(out_acc_rows, where).transpose(0, 1).unsqueeze(0)
    acc_lse = _pick_lse(lse_acc, where).unsqueeze(0)
    merge_into_(acc_out, acc_lse, blk_out, blk_lse)
    _put(out_acc_rows, ranges, where.index, acc_out[0].transpose(0, 1))
    _put(lse_acc, ranges, where.index, acc_lse[0], dim=1)


def _coalesced(runs, masked: bool):
    """A launch's runs, merged where neighbours share a role when the launch has a row mask
    (the rows between, masked, are neither read nor written): fewer merges for gapped launches."""
    if not masked:
        return runs
    out = []
    for a, b, role in runs:
        if out and out[-1][2] == role:
            out[-1] = (out[-1][0], b, role)
        else:
            out.append((a, b, role))
    return out


def _merge_runs_(acc_rows, lse_acc, where: Where, blk_out, blk_lse, result_rows, runs) -> None:
    """merge_launch_ run by run (plan/fuse.py row_runs): ONLY merges the result in place, FIRST
    from the result into the accumulator, MID in the accumulator, LAST from it into the result.
    Rows are in place (a slice, or a window at its offsets: where.span)."""
    w0 = where.span[0]
    for a, b, role in _coalesced(runs, where.used is not None):
        src = result_rows if role in (ONLY, FIRST) else acc_rows
        dst = result_rows if role in (ONLY, LAST) else acc_rows
        c, d = a - w0, b - w0
        merge_into_(dst[a:b].transpose(0, 1).unsqueeze(0), lse_acc[:, a:b].unsqueeze(0), blk_out[:, :, c:d],
                    blk_lse[:, :, c:d], rows_used=None if where.used is None else where.used[c:d],
                    out_src=src[a:b].transpose(0, 1).unsqueeze(0))


def launch_backward(kernel: Kernel, dout_rows, q_rows, k_rows, v_rows, out_rows, lse_b, li: LaunchIndex,
                    scale, softcap, dq=None, dk=None, dv=None):
    """One launch's (dq (T, H, D), dk, dv (T_k, Hkv, D/Dv)) on one batch row; lse_b: (H, L).
    dq / dk / dv: tensors to write that gradient into (else it comes back fresh)."""
    q, dout, out = (_pick(x, li.q) for x in (q_rows, dout_rows, out_rows))
    k, v = _pick(k_rows, li.k), _pick(v_rows, li.k)
    lse = _pick_lse(lse_b, li.q)
    if dq is None and dk is None and dv is None:
        return kernel.varlen_backward(dout, q, k, v, out, lse, li.seqs, li.launch.window, scale, softcap=softcap)
    got = kernel.varlen_backward_into(dout, q, k, v, out, lse, li.seqs, li.launch.window, scale, softcap=softcap,
                                      dq=dq, dk=dk, dv=dv)
    return landed(got, (dq, dk, dv))


def backward_launch_(kernel: Kernel, fixed_b, k_rows, v_rows, lse_b, li: LaunchIndex, scale, softcap, b: int,
                     into_q=None, into_kv=None, later_q=(0, 0), dkv_acc=None, later_kv=(0, 0), dq_result=None,
                     land_q: Optional[Landing] = None, dq_slot: Optional[torch.Tensor] = None, dkv_into=None):
    """One launch's backward on batch row b, its dQ landed: added into the accumulator's rows, or
    (`into_q`: the dQ result, which the pass's first launch writes) written there and its rows
    `later_q` seeded into the accumulator. `fixed_b`: (dout, q, out, dQ accumulator) rows of row b.
    Returns the launch's (dK, dV) for the caller to add; or None where `into_kv` (the dK and dV
    results) took them, their keys `later_kv` then seeded into `dkv_acc` ((B, Hkv, L, D) each).
    `land_q`: where it routes this launch's rows (Landing.of), its dQ is added into the
    accumulator or the dQ result (`dq_result`, (B, H, L, D)) by role (add_runs_). `dq_slot`:
    where the launch's dQ rows are kept whole (Slots), summed at the end of the pass instead.
    `dkv_into`: (dK, dV) rows shaped like the launch's keys to write them into (then None returns)."""
    dout_b, q_b, out_b, dq_b = fixed_b
    into = dict(dq=dq_slot if into_q is None else rows(into_q, b),
                dk=None if into_kv is None else rows(into_kv[0], b),
                dv=None if into_kv is None else rows(into_kv[1], b))
    if dkv_into is not None:
        into["dk"], into["dv"] = dkv_into
    dq_t, dk_t, dv_t = launch_backward(kernel, dout_b, q_b, k_rows, v_rows, out_b, lse_b, li, scale, softcap, **into)
    runs = None if land_q is None or into_q is not None else land_q.of(li)
    if dq_slot is not None:
        pass  # (summed with the other kept launches' at the end of the pass)
    elif runs is not None:
        add_runs_(dq_b, rows(dq_result, b), li.q, dq_t, runs, land_q, li)
    elif into_q is None:
        add_rows_(dq_b, li.q, dq_t)
    else:  # the rows later launches add to, in float32
        seed_later_(dq_b, dq_t, later_q)
    if dkv_into is not None:
        return None
    if into_kv is None:
        return dk_t, dv_t
    for acc, got in zip(dkv_acc, (dk_t, dv_t)):
        seed_later_(rows(acc, b), got, later_kv)
    return None


def add_rows_(acc_rows: torch.Tensor, where: Where, grad: torch.Tensor) -> None:
    """acc_rows[rows] += grad along dim 0 (rows: `where`; gathered ranges may repeat: each range's
    share is added, in order)."""
    if where.one_slice:
        if where.used is not None:  # the rows between (any value: the kernel left them) as zeros
            grad = torch.where(where.used.view(-1, *(1,) * (grad.dim() - 1)), grad, 0)
        acc_rows[where.span[0]:where.span[1]].add_(grad)
    elif where.gapped or (len(where.ranges) <= MAX_RANGES and where.ranges):
        for a, b, c, d in _pieces(where):
            acc_rows[a:b].add_(grad[c:d])  # (not `+=` on a slice: that adds, then copies back onto itself)
    else:
        acc_rows.index_add_(0, where.index, grad.to(acc_rows.dtype))


def add_runs_(acc_rows: torch.Tensor, result_rows: torch.Tensor, where: Where, grad: torch.Tensor, runs,
              land: Optional[Landing] = None, li: Optional[LaunchIndex] = None) -> None:
    """add_rows_ run by run (plan/fuse.py row_runs), rows in place (where.span): ONLY adds into
    the result (in its dtype: computed in float32, rounded once, as a float32 accumulator cast
    back), FIRST copies the result's rows into the accumulator and adds, MID adds there, LAST
    writes accumulator + grad into the result (rounded once). The runs hold only the launch's
    own rows (never a row between: a FIRST or LAST there would overwrite another's). On CUDA one
    launch does it all with the launch's roles per row (`land`, `li`: exec/merge.py land_add_)."""
    w0 = where.span[0]
    if land is not None and can_land_in_one_launch(acc_rows, result_rows, grad):
        w1 = where.span[1]
        land_add_(acc_rows[w0:w1], result_rows[w0:w1], grad, land.roles_of(li, grad.device))
        return
    for a, b, role in runs:
        g = grad[a - w0:b - w0]
        if role == ONLY:
            result_rows[a:b].add_(g)
        elif role == FIRST:
            acc_rows[a:b].copy_(result_rows[a:b])
            acc_rows[a:b].add_(g)
        elif role == MID:
            acc_rows[a:b].add_(g)
        else:
            torch.add(acc_rows[a:b], g, out=result_rows[a:b])
