"""Running a ring step's launches (dtcp/plan/fuse.py): gathers, one varlen call, merges.

Tensors here are in *rows* form, one batch row at a time: (L, H, D) views of the ring's
(B, H, L, D) tensors (x[b].transpose(0, 1): no copy; FlashAttention-4 and flash take such
strides). A launch's query rows and keys are a view where they tile one range in order, else
one copy of each of its ranges (few ranges; an index_select beyond `MAX_RANGES`). Its output
lands on float32 accumulators, (B, L, H, Dv) and lse (B, H, L), with one merge per launch (a
slice, or gather/merge/scatter when the rows are scattered); dK/dV are added range by range (a
key two sequences share gets both shares, in a fixed order).

Why ranges and not index tensors: rows form is a transposed view, and an index_select or
index_add_ along its first dim runs a strided gather/scatter kernel; on one H100, for a 64K-token
rank, those took 15 of a pass's 25 ms (FA4's own kernels 9 ms; bench_split --profile, issue 23).
A copy per range is a plain strided copy, at memory speed.

Index tensors and cumulative lengths are built once per plan and device and cached with the
plan object (plans are cached by value, so a new document structure is a new plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import config
from ..kernels import Kernel, VarlenSeqs
from ..plan import RingPlan
from ..plan.fuse import Launch, fused_launches
from .allgather import bounded_put
from .merge import merge_into_


@dataclass(frozen=True)
class LaunchIndex:
    """A launch with what its calls need on the device: index tensors for scattered rows or
    keys (None where they tile a range: a slice then) and the varlen cumulative lengths."""

    launch: Launch
    q_index: Optional[torch.Tensor]
    k_index: Optional[torch.Tensor]
    seqs: VarlenSeqs


_FUSED: dict = {}


def fused_steps(plan: RingPlan, kernel: Kernel, device: torch.device) -> Optional[tuple[tuple[LaunchIndex, ...], ...]]:
    """Each step's launches for `kernel`, or None where the plan runs task by task: the kernel
    has no one-launch varlen form, the setting is off, fusing saves no launch, or the kernel
    refuses a launch."""
    if not (kernel.varlen_one_launch and config.ring_one_launch):
        return None
    key = (id(plan), kernel.name, device)
    hit = _FUSED.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    steps = fused_launches(plan, kernel.reject_varlen_reason)
    fused = None
    if steps is not None:  # keys counted from the held span's start, as the ring holds them
        fused = tuple(tuple(_indexed(_from(launch, step.span[0]), device) for launch in launches)
                      for step, launches in zip(plan.steps, steps))
    bounded_put(_FUSED, key, (plan, fused))
    return fused


def _from(launch: Launch, origin: int) -> Launch:
    return Launch(launch.window, launch.q_ranges, tuple((a - origin, b - origin) for a, b in launch.k_ranges))


def _indexed(launch: Launch, device) -> LaunchIndex:
    def index(ranges, span):
        if span is not None:
            return None
        return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)

    cu = torch.tensor([launch.cu_q, launch.cu_k], dtype=torch.int32).to(device)
    lens = launch.seq_lens
    seqs = VarlenSeqs(launch.cu_q, launch.cu_k, cu[0], cu[1], max(q for q, _ in lens), max(k for _, k in lens))
    return LaunchIndex(launch, index(launch.q_ranges, launch.q_span), index(launch.k_ranges, launch.k_span), seqs)


def fills_rows(launches, local_len: int) -> bool:
    """Does a step's first launch cover every query row of the rank, in order (its output then
    stands for the whole accumulator)?"""
    return bool(launches) and launches[0].launch.q_span == (0, local_len)


def fills_keys(launches, kv_len: int) -> bool:
    """Does a step's first launch take every key of the block, in order, each once?"""
    return bool(launches) and launches[0].launch.k_span == (0, kv_len)


def rows(x: torch.Tensor, b: int) -> torch.Tensor:
    """Batch row b of a (B, H, L, D) tensor as (L, H, D), a view."""
    return x[b].transpose(0, 1)


#: a launch's rows or keys in at most this many ranges are copied range by range; more, one index_select
MAX_RANGES = 32


def _pick(x_rows: torch.Tensor, span, index, ranges) -> torch.Tensor:
    """Rows of x_rows (L, ...) along dim 0: the slice `span`, else `ranges` (= `index`) copied."""
    if index is None:
        return x_rows[span[0]:span[1]]
    if len(ranges) <= MAX_RANGES:
        return torch.cat([x_rows[a:b] for a, b in ranges])
    return x_rows.index_select(0, index)


def _pick_lse(lse_rows: torch.Tensor, span, index, ranges) -> torch.Tensor:
    """Columns of a (H, L) lse: a slice, else `ranges` (= `index`), contiguous."""
    if index is None:
        return lse_rows[:, span[0]:span[1]].contiguous()
    if len(ranges) <= MAX_RANGES:
        return torch.cat([lse_rows[:, a:b] for a, b in ranges], dim=1)
    return lse_rows.index_select(1, index)


def _put(x_rows: torch.Tensor, ranges, index, values: torch.Tensor, dim: int = 0) -> None:
    """x_rows[rows] = values along `dim` (rows: `ranges`, = `index`, distinct)."""
    if len(ranges) <= MAX_RANGES:
        off = 0
        for a, b in ranges:
            x_rows.narrow(dim, a, b - a).copy_(values.narrow(dim, off, b - a))
            off += b - a
        return
    x_rows.index_copy_(dim, index, values)


def launch_forward(kernel: Kernel, q_rows, k_rows, v_rows, li: LaunchIndex, scale, softcap):
    """One launch on one batch row: (out (T, H, Dv), lse (H, T) float32). k_rows/v_rows: the
    held span's keys (the launch counts keys from its start)."""
    launch = li.launch
    q = _pick(q_rows, launch.q_span, li.q_index, launch.q_ranges)
    k = _pick(k_rows, launch.k_span, li.k_index, launch.k_ranges)
    v = _pick(v_rows, launch.k_span, li.k_index, launch.k_ranges)
    return kernel.varlen_forward(q, k, v, li.seqs, launch.window, scale, softcap=softcap)


def merge_launch_(out_acc_rows: torch.Tensor, lse_acc: torch.Tensor, li: LaunchIndex, out, lse) -> None:
    """Fold a launch's (out (T, H, Dv), lse (H, T)) into one batch row's accumulators:
    out_acc_rows (L, H, Dv), lse_acc (H, L)."""
    launch = li.launch
    blk_out, blk_lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)  # (1, H, T, Dv), (1, H, T)
    if li.q_index is None:
        a, b = launch.q_span
        merge_into_(out_acc_rows[a:b].transpose(0, 1).unsqueeze(0), lse_acc[:, a:b].unsqueeze(0), blk_out, blk_lse)
        return
    ranges = launch.q_ranges  # (distinct rows: a launch's sequences never share a query row)
    acc_out = _pick(out_acc_rows, None, li.q_index, ranges).transpose(0, 1).unsqueeze(0)
    acc_lse = _pick_lse(lse_acc, None, li.q_index, ranges).unsqueeze(0)
    merge_into_(acc_out, acc_lse, blk_out, blk_lse)
    _put(out_acc_rows, ranges, li.q_index, acc_out[0].transpose(0, 1))
    _put(lse_acc, ranges, li.q_index, acc_lse[0], dim=1)


def launch_backward(kernel: Kernel, dout_rows, q_rows, k_rows, v_rows, out_rows, lse_b, li: LaunchIndex,
                    scale, softcap):
    """One launch's (dq (T, H, D), dk, dv (T_k, Hkv, D/Dv)) on one batch row; lse_b: (H, L)."""
    launch = li.launch
    q_span, q_index = launch.q_span, li.q_index
    q, dout, out = (_pick(x, q_span, q_index, launch.q_ranges) for x in (q_rows, dout_rows, out_rows))
    k = _pick(k_rows, launch.k_span, li.k_index, launch.k_ranges)
    v = _pick(v_rows, launch.k_span, li.k_index, launch.k_ranges)
    return kernel.varlen_backward(dout, q, k, v, out, _pick_lse(lse_b, q_span, q_index, launch.q_ranges), li.seqs,
                                  launch.window, scale, softcap=softcap)


def add_rows_(acc_rows: torch.Tensor, span, index, grad: torch.Tensor, ranges=()) -> None:
    """acc_rows[rows] += grad along dim 0 (rows: the slice `span`, else `ranges` (= `index`),
    which may repeat: each range's share is added, in order)."""
    if index is None:
        acc_rows[span[0]:span[1]] += grad
    elif len(ranges) <= MAX_RANGES and ranges:
        off = 0
        for a, b in ranges:
            acc_rows[a:b] += grad[off:off + b - a]
            off += b - a
    else:
        acc_rows.index_add_(0, index, grad.to(acc_rows.dtype))
