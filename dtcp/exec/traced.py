"""The all-gather schedule written in differentiable, traceable ops, for torch.compile.

Inside a compiled graph the custom op `dtcp::ring_attention_forward` runs its body as eager
PyTorch: a few dozen operations of host time per attention call, which at short sequences costs
more than the attention (docs/integrations/torchtitan.md has the measurement).
When the all-gather schedule applies, the same computation written with a functional all-gather
(whose backward is a reduce-scatter), slices and an aten attention op with registered autograd
is traced into the graph instead: the compiler sees every operation, fuses the copies and derives
the backward, and no Python runs per call.

`dtcp::ring_attention` (a CompositeImplicitAutograd op, so tracing decomposes it) routes each call:
the traced all-gather where `traced_reason` finds nothing against it, else the custom op (see
dtcp/ops.py). Eager calls do not come here.

With PyTorch's CUDA flash kernel, a zigzag rank's two tasks (and every batch row) are one varlen
launch (`allgather_attention_traced_one_launch`): every (row, task) pair is one sequence, the
packed keys are one fused copy out of the gathered shards, and the output is the kernel's own
buffer, with no concatenation. Forward and backward each make one attention launch per layer
instead of two, and a few copies fewer: host time is what bounds short sequences.

Accuracy: K/V are gathered in float32 (float64 for float64), so the all-gather's backward sums
dK/dV over ranks in float32, and each task's K/V slice is cast back to the input dtype for the
kernel; the two tasks' dK/dV shares are summed in float32 by the cast's backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _compat
from ..comm.collectives import all_gather_traceable
from ..config import config
from ..kernels import Kernel, acc_dtype, band_mask_traceable
from ..plan import AllGatherPlan


def traced_reason(plan: AllGatherPlan, kernel: Kernel, q: torch.Tensor) -> Optional[str]:
    """Why this call cannot take the traced all-gather, or None."""
    if not plan.rows_tiled:
        return "some rows see no key (document padding)"
    if not all(t.is_full or t.is_bottom_right_causal for t in plan.tasks):
        return "a task has a window or document band"
    if kernel.name == "flash" and q.device.type == "cuda":
        return None
    if kernel.name == "math":
        return None
    return f"no traceable form of the {kernel.name!r} kernel"


def one_launch_reason(plan: AllGatherPlan, kernel: Kernel, q: torch.Tensor) -> Optional[str]:
    """Why the traced call cannot be one varlen flash launch, or None (it can)."""
    if not config.one_launch:
        return "switched off (dtcp.config.one_launch = False)"
    if kernel.name != "flash" or q.device.type != "cuda":
        return "one varlen launch is PyTorch's CUDA flash kernel"
    if len(plan.tasks) < 2:
        return "one task is already one launch"
    if not (all(t.is_full for t in plan.tasks) or all(t.is_bottom_right_causal for t in plan.tasks)):
        return "one launch takes one causal flag for every task"
    return None


@dataclass(frozen=True)
class PackedTasks:
    """Every (batch row, task) pair of a plan as one sequence of a varlen call: row b's queries
    are rows [b*L, (b+1)*L) of the packed q (tasks in query order, which tile the shard), and its
    keys are each task's key range in turn, `row_keys` tokens per row."""

    rows: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool

    @property
    def row_keys(self) -> int:
        return sum(self.k_lens)

    def cu_seqlens(self, lens: tuple[int, ...], device) -> torch.Tensor:
        """(rows * T + 1,) int32 cumulative lengths, written as arithmetic on an arange so that
        it traces into the graph (a traced function may not hold a cached device tensor)."""
        i = torch.arange(self.rows * len(lens) + 1, dtype=torch.int32, device=device)
        cu = (i // len(lens)) * sum(lens)
        for t in range(len(lens) - 1):
            cu = cu + (i % len(lens) > t).to(torch.int32) * lens[t]
        return cu


def flash_varlen_differentiable(q, k, v, packed: PackedTasks, scale: float):
    """q (Tq, Hq, D), k/v (Tk, Hkv, D) -> out (Tq, Hq, D), lse (Hq, Tq): one
    aten._flash_attention_forward launch over the packed sequences (autograd registered in
    derivatives.yaml; causal is bottom-right per sequence)."""
    cu_q, cu_k = packed.cu_seqlens(packed.q_lens, q.device), packed.cu_seqlens(packed.k_lens, q.device)
    return _compat.flash_varlen_forward_differentiable(q, k, v, cu_q, cu_k, max(packed.q_lens), max(packed.k_lens),
                                                       packed.causal, scale)


def allgather_attention_traced_one_launch(q, k, v, pg, plan: AllGatherPlan, scale: float, attention=None):
    """The traced all-gather with every task of every batch row in one varlen launch.

    K and V are gathered token-major, (N*2, B, L, Hkv, D): a straight copy when they are
    transposed views of (B, L, H, D) projections, as in most models. The packed keys (2, B*Tk,
    Hkv, D) are one fused copy (slices of the gathered shards, cast to the input dtype); the
    packed queries are a view when q is such a transposed view. Returns out (B, Hq, L, D) as a
    transposed view of the kernel's (B*L, Hq, D) output, as SDPA's flash path returns it, and
    lse (B, Hq, L). `attention` (default flash_varlen_differentiable) is the varlen call; tests
    pass a float64 reference."""
    attention = attention or flash_varlen_differentiable
    acc = acc_dtype(q.dtype)
    b, hq, l_len, d = q.shape
    hkv = k.shape[1]
    packed = PackedTasks(b, tuple(t.q_len for t in plan.tasks), tuple(t.k_len for t in plan.tasks),
                         causal=not plan.tasks[0].is_full)
    send = torch.stack((k.transpose(1, 2), v.transpose(1, 2))).to(acc)  # (2, B, L, Hkv, D)
    per_rank = all_gather_traceable(send, pg).view(plan.world_size, 2, b, l_len, hkv, d)
    pieces = [per_rank[rank][:, :, lo:hi] for t in plan.tasks for rank, lo, hi in plan.key_slices(t.k_start, t.k_end)]
    kv = torch.cat(pieces, dim=2).to(q.dtype)  # (2, B, Tk, Hkv, D), Tk = packed.row_keys
    kv = kv.reshape(2, b * packed.row_keys, hkv, d)
    out, lse = attention(q.transpose(1, 2).reshape(b * l_len, hq, d), kv[0], kv[1], packed, scale)
    out = out.view(b, l_len, hq, d).transpose(1, 2)
    lse = lse.view(hq, b, l_len).transpose(0, 1)
    return out, lse.to(acc).contiguous()


def allgather_attention_traced(q, k, v, pg, plan: AllGatherPlan, kernel: Kernel, scale: float):
    """(out (B, Hq, L, D), lse (B, Hq, L)), differentiable in q, k, v; see the module docstring."""
    if one_launch_reason(plan, kernel, q) is None:
        return allgather_attention_traced_one_launch(q, k, v, pg, plan, scale)
    acc = acc_dtype(q.dtype)
    b, h, l_len, d = k.shape
    gathered = all_gather_traceable(torch.stack((k, v)).to(acc), pg)  # (N*2, B, Hkv, L, D)
    per_rank = gathered.view(plan.world_size, 2, b, h, l_len, d)
    pieces = [per_rank[rank][:, :, :, lo:hi] for rank, lo, hi in plan.key_slices(0, plan.seq_len)]
    kv = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=3)  # (2, B, Hkv, S, D)
    outs, lses = [], []
    for task in plan.tasks:
        qt = q[:, :, task.q_start:task.q_end]
        kt = kv[0][:, :, task.k_start:task.k_end]
        vt = kv[1][:, :, task.k_start:task.k_end]
        if kernel.name == "flash":
            # the kernel takes the input dtype; its dK/dV shares come back in it, as in eager
            o, lse = _compat.flash_attention_differentiable(qt, kt.to(q.dtype), vt.to(q.dtype), not task.is_full, scale)
        else:
            # float32 K/V straight in: the shares stay float32 up to the sum, as in eager
            o, lse = kernel.forward(qt, kt, vt, task.lo, task.hi, scale, mask_fn=band_mask_traceable)
            lse = lse.detach()
        outs.append(o)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return out.contiguous(), lse.to(acc).contiguous()
