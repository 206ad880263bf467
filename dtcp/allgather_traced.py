"""The all-gather schedule written in differentiable, traceable ops, for torch.compile.

Inside a compiled graph the custom op `dtcp::ring_attention_forward` runs its body as eager
PyTorch: a few dozen operations of host time per attention call, which at short sequences costs
more than the attention (measured in torchtitan's compiled debug model: see docs/torchtitan.md).
When the all-gather schedule applies, the same computation written with a functional all-gather
(whose backward is a reduce-scatter), slices and an aten attention op with registered autograd
is traced into the graph instead: the compiler sees every operation, fuses the copies and derives
the backward, and no Python runs per call.

`dtcp::ring_attention` (a CompositeImplicitAutograd op, so tracing decomposes it) routes each call:
the traced all-gather where `traced_reason` finds nothing against it, else the custom op. Eager
calls do not come here (ops.ring_attention_eager_or_op).

Accuracy: K/V are gathered in float32 (float64 for float64), so the all-gather's backward sums
dK/dV over ranks in float32, and each task's K/V slice is cast back to the input dtype for the
kernel; the two tasks' dK/dV shares are summed in float32 by the cast's backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _compat
from .kernels import Kernel, acc_dtype, band_mask_traceable
from .schedule import AllGatherPlan, Task


def _is_bottom_right_causal(t: Task) -> bool:
    # key j visible from query i iff j - i <= k_len - q_len: causal aligned at the last key
    return t.lo is None and t.hi == t.k_len - t.q_len


def traced_reason(plan: AllGatherPlan, kernel: Kernel, q: torch.Tensor) -> Optional[str]:
    """Why this call cannot take the traced all-gather, or None."""
    if not plan.rows_tiled:
        return "some rows see no key (document padding)"
    if not all(t.is_full or _is_bottom_right_causal(t) for t in plan.tasks):
        return "a task has a window or document band"
    if kernel.name == "flash" and q.device.type == "cuda":
        return None
    if kernel.name == "math":
        return None
    return f"no traceable form of the {kernel.name!r} kernel"


def allgather_attention_traced(q, k, v, pg, plan: AllGatherPlan, kernel: Kernel, scale: float):
    """(out (B, Hq, L, D), lse (B, Hq, L)), differentiable in q, k, v; see the module docstring."""
    acc = acc_dtype(q.dtype)
    b, h, l_len, d = k.shape
    n, r_count, p_len = plan.world_size, plan.runs_per_rank, plan.piece_len
    gathered = _compat.all_gather_autograd(torch.stack((k, v)).to(acc), pg)  # (N*2, B, Hkv, L, D)
    per_rank = gathered.view(n, 2, b, h, l_len, d)
    pieces = []
    for p in plan.global_order:  # piece p is run p % R of rank p // R
        lo = (p % r_count) * p_len
        pieces.append(per_rank[p // r_count][:, :, :, lo:lo + p_len])
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
