"""`torch.library` custom ops around the ring, with fake (meta) implementations and autograd,
so `torch.compile(fullgraph=True)` traces callers without graph breaks. The ring's
communication and kernels run inside the ops, opaque to the compiler, which is what keeps the
transfer/compute overlap intact in compiled code.

The process group travels by name and the layout by its spec string (see Layout.spec).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import _compat
from .kernels import Kernel, acc_dtype, select_kernel
from .layouts import layout_from_spec
from .ring import ring_backward, ring_forward
from .schedule import RingPlan, ring_plan


@lru_cache(maxsize=512)
def _plans(layout_spec: str, local_len: int, world_size: int, is_causal: bool) -> tuple[RingPlan, ...]:
    layout = layout_from_spec(layout_spec)
    return tuple(ring_plan(layout, local_len, world_size, r, is_causal) for r in range(world_size))


def prepare(q, k, group_name: str, layout: str, is_causal: bool, backend: str) -> tuple:
    """(process group, this rank's plan, kernel). The kernel is chosen against every rank's tasks
    so that all ranks use the same one."""
    pg = _compat.group_from_name(group_name)
    n, r = pg.size(), pg.rank()
    plans = _plans(layout, q.shape[2], n, is_causal)
    all_tasks = [task for plan in plans for step in plan.steps for task in step.tasks]
    kernel: Kernel = select_kernel(backend, q, k, all_tasks)
    return pg, plans[r], kernel


@torch.library.custom_op("dtcp::ring_attention_forward", mutates_args=())
def ring_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    pg, plan, kernel = prepare(q, k, group_name, layout, is_causal, backend)
    return ring_forward(q, k, v, pg, plan, kernel, scale)


@ring_attention_forward.register_fake
def _(q, k, v, group_name, layout, is_causal, scale, backend):
    # The real op returns fresh contiguous tensors; the fakes must have the same strides.
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dtcp::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pg, plan, kernel = prepare(q, k, group_name, layout, is_causal, backend)
    return ring_backward(dout, q, k, v, out, lse, pg, plan, kernel, scale)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group_name, layout, is_causal, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    # lse is handed to users detached (see api.ring_attention), so dlse carries nothing.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


ring_attention_forward.register_autograd(_backward, setup_context=_setup_context)
