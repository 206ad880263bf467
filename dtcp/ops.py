"""`torch.library` custom ops around the ring, with fake (meta) implementations and autograd,
so `torch.compile(fullgraph=True)` traces callers without graph breaks. The ring's
communication and kernels run inside the ops, opaque to the compiler, which is what keeps the
transfer/compute overlap intact in compiled code.

The process group travels by name and the layout by its spec string (see Layout.spec).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache
from typing import Optional, Union
import weakref

import torch

from . import _compat, allgather_traced
from .allgather import allgather_backward, allgather_forward
from .allgather_varlen import allgather_varlen_backward, allgather_varlen_forward
from .allgather_traced import allgather_attention_traced, traced_reason
from .kernels import acc_dtype, select_kernel
from .layouts import DocZigzag, layout_from_spec
from .ring import ring_backward, ring_forward
from .schedule import (
    AllGatherPlan, AttnMask, RingPlan, VarlenPlan, allgather_plans, choose_kv_exchange, ring_plans, varlen_reason,
    varlen_window,
)


@lru_cache(maxsize=512)
def _plans(
    layout_spec: str, local_len: int, world_size: int, is_causal: bool,
    window: tuple[int, int] = (-1, -1), cu_seqlens: Optional[tuple[int, ...]] = None,
    kv_exchange: str = "ring",
) -> tuple[Union[RingPlan, AllGatherPlan], ...]:
    """Every rank's plan; kv_exchange is "ring" or "allgather" (already resolved)."""
    layout = layout_from_spec(layout_spec)
    seq_len = local_len * world_size
    segments = None
    if cu_seqlens is not None:
        segments = segments_from_cu_seqlens(cu_seqlens, seq_len)
    elif isinstance(layout, DocZigzag):
        segments = layout.segments(world_size)  # the layout carries its documents
    mask = AttnMask.make(is_causal, window, segments)
    if kv_exchange == "allgather":
        return allgather_plans(layout, local_len, world_size, is_causal, mask)
    return ring_plans(layout, local_len, world_size, is_causal, mask)


def row_cu_seqlens(cu: tuple[int, ...], batch: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Each batch row's document boundaries (0, ..., S) from `cu_seqlens` values: boundaries of
    the sequence, shared by every row (ending at S), or, for a batch of B > 1 rows with their
    own documents, boundaries over the batch flattened row-major (ending at B*S, with a boundary
    at every row start b*S: documents do not cross rows; torchtitan's and flash-attn's packed
    batches). Checks the values."""
    if batch > 1 and len(cu) >= 2 and cu[0] == 0 and cu[-1] == batch * seq_len:
        segments_from_cu_seqlens(cu, batch * seq_len)  # checks the flattened boundaries never decrease
        rows = []
        for b in range(batch):
            lo, hi = b * seq_len, (b + 1) * seq_len
            inside = [c - lo for c in cu if lo <= c <= hi]
            if inside[0] != 0:
                raise ValueError(
                    f"cu_seqlens ends at B*S = {batch}x{seq_len}, so it gives each batch row its own documents over "
                    f"the flattened batch; then every row start b*S must be a boundary, and {lo} (row {b}) is not: "
                    "a document crosses rows. Split it at the row start"
                )
            rows.append(tuple(inside))
        return tuple(rows)
    segments_from_cu_seqlens(cu, seq_len, batch)  # checks; raises with the fix
    return (cu,) * batch


def segments_from_cu_seqlens(cu: tuple[int, ...], seq_len: int, batch: int = 1) -> tuple[tuple[int, int], ...]:
    """Document ranges from cumulative lengths; checks them (empty documents are allowed: a
    repeated boundary, as in cu_seqlens padded to a fixed size)."""
    fix = "cu_seqlens must be the global document boundaries of the packed sequence: 0 = c0 <= c1 <= ... <= cn = S"
    if len(cu) < 2:
        raise ValueError(f"{fix}; got {len(cu)} value(s). One document: torch.tensor([0, S], dtype=torch.int32)")
    if cu[0] != 0:
        raise ValueError(f"{fix}; it starts at {cu[0]}, not 0")
    if cu[-1] != seq_len:
        per_row = f" (or B*S = {batch * seq_len}, each batch row with its own documents)" if batch > 1 else ""
        raise ValueError(
            f"{fix}{per_row}; it ends at {cu[-1]} but the sequence has S = {seq_len} tokens (S_local x world "
            "size). Pass the boundaries of the whole packed sequence, not of this rank's shard"
        )
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{fix}; it decreases at index {i} ({cu[i - 1]} -> {cu[i]})")
    return tuple((a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a)


# The values of the last few cu_seqlens tensors seen: a model passes one tensor to every layer,
# forward and backward, and reading a CUDA tensor's values waits for the GPU.
_CU_VALUES: list = []


def _cu_tuple(cu_seqlens: Optional[torch.Tensor]) -> Optional[tuple[int, ...]]:
    if cu_seqlens is None:
        return None
    for ref, version, values in _CU_VALUES:
        if ref() is cu_seqlens and cu_seqlens._version == version:
            return values
    values = tuple(int(c) for c in cu_seqlens.tolist())
    _CU_VALUES.insert(0, (weakref.ref(cu_seqlens), cu_seqlens._version, values))
    del _CU_VALUES[4:]
    return values


def prepare(q, k, group_name: str, layout: str, is_causal: bool, backend: str,
            window: tuple[int, int] = (-1, -1), cu_seqlens: Optional[torch.Tensor] = None,
            kv_exchange: str = "auto") -> tuple:
    """(process group, this rank's plan, kernel). The plan is a RingPlan or an AllGatherPlan
    (kv_exchange, resolved the same way on every rank: from shapes, layout and device only), a
    VarlenPlan (the all-gather schedule under documents, as one varlen kernel call), or a tuple
    of one plan per batch row (rows with their own documents that no varlen call serves). The
    kernel is chosen against every rank's tasks so that all ranks use the same one."""
    pg = _compat.group_from_name(group_name)
    n, r = pg.size(), pg.rank()
    cu = _cu_tuple(cu_seqlens)
    key = (layout, tuple(q.shape), tuple(k.shape), k.dtype, q.device.type, n, r, is_causal, tuple(window), cu,
           kv_exchange, backend)
    route = _ROUTES.get(key)
    if route is None:
        if len(_ROUTES) >= 256:
            _ROUTES.clear()
        route = _ROUTES[key] = _route(q, k, layout, n, r, is_causal, tuple(window), cu, kv_exchange, backend)
    return (pg,) + route


# (plan, kernel) per call signature: plans are built once, and a VarlenPlan keeps its identity
# (allgather_varlen caches its index tensors per plan object).
_ROUTES: dict[tuple, tuple] = {}


def _route(q, k, layout: str, n: int, r: int, is_causal: bool, window, cu, kv_exchange: str, backend: str):
    local_len, batch = q.shape[2], q.shape[0]
    gathered_kv_bytes = 2 * k.numel() * k.element_size() * n
    exchange = choose_kv_exchange(kv_exchange, layout_from_spec(layout), local_len, n, q.device.type,
                                  gathered_kv_bytes)
    row_cus = (None,) if cu is None else row_cu_seqlens(cu, batch, local_len * n)
    distinct = list(dict.fromkeys(row_cus))
    row_plans = {c: _plans(layout, local_len, n, is_causal, window, c, exchange) for c in distinct}
    all_tasks = [task for plans in row_plans.values() for plan in plans for task in _tasks_of(plan)]
    per_row = len(distinct) > 1
    if exchange == "allgather" and cu is not None:
        # Documents under the all-gather schedule: one varlen call for the whole batch where a
        # kernel takes it in one launch, and for rows with their own documents (instead of a
        # loop over rows) with any kernel that takes varlen calls.
        kernel = select_kernel(backend, q, k, all_tasks, prefer_varlen=True)
        window_br = varlen_window(AttnMask.make(is_causal, window))
        plan = VarlenPlan(tuple(row_plans[c][r] for c in row_cus), window_br)
        if (kernel.supports_varlen and (per_row or kernel.varlen_one_launch) and plan.rows_tiled
                and varlen_reason(all_tasks, window_br) is None):
            return plan, kernel
    else:
        kernel = select_kernel(backend, q, k, all_tasks)
    if per_row:
        return tuple(row_plans[c][r] for c in row_cus), kernel
    return row_plans[distinct[0]][r], kernel


def _tasks_of(plan) -> list:
    if isinstance(plan, AllGatherPlan):
        return list(plan.tasks)
    return [task for step in plan.steps for task in step.tasks]


def _run_forward(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right, cu_seqlens,
                 kv_exchange="auto", keep=False):
    """(out, lse, kept): kept is what the backward may reuse (the all-gather schedule's gathered
    K/V) when `keep`, else None."""
    pg, plan, kernel = prepare(q, k, group_name, layout, is_causal, backend, (window_left, window_right), cu_seqlens,
                               kv_exchange)
    with _on_device_of(q):
        return _forward_with(plan, q, k, v, pg, kernel, scale, keep)


def _forward_with(plan, q, k, v, pg, kernel, scale, keep):
    if isinstance(plan, VarlenPlan):
        return allgather_varlen_forward(q, k, v, pg, plan, kernel, scale, keep_kv=keep)
    if isinstance(plan, AllGatherPlan):
        return allgather_forward(q, k, v, pg, plan, kernel, scale, keep_kv=keep)
    if isinstance(plan, RingPlan):
        return ring_forward(q, k, v, pg, plan, kernel, scale) + (None,)
    # one plan per batch row (rows with their own documents, no varlen kernel): a call per row,
    # the same calls in the same order on every rank
    rows = [_forward_with(p, q[b:b + 1], k[b:b + 1], v[b:b + 1], pg, kernel, scale, keep) for b, p in enumerate(plan)]
    return (torch.cat([o for o, _, _ in rows]), torch.cat([lse for _, lse, _ in rows]),
            [kept for _, _, kept in rows] if keep else None)


def _run_backward(dout, q, k, v, out, lse, group_name, layout, is_causal, scale, backend,
                  window_left, window_right, cu_seqlens, kv_exchange="auto", kept=None):
    pg, plan, kernel = prepare(q, k, group_name, layout, is_causal, backend, (window_left, window_right), cu_seqlens,
                               kv_exchange)
    with _on_device_of(q):
        return _backward_with(plan, dout, q, k, v, out, lse, pg, kernel, scale, kept)


def _backward_with(plan, dout, q, k, v, out, lse, pg, kernel, scale, kept):
    if isinstance(plan, VarlenPlan):
        return allgather_varlen_backward(dout, q, k, v, out, lse, pg, plan, kernel, scale, kv=kept)
    if isinstance(plan, AllGatherPlan):
        return allgather_backward(dout, q, k, v, out, lse, pg, plan, kernel, scale, kv=kept)
    if isinstance(plan, RingPlan):
        return ring_backward(dout, q, k, v, out, lse, pg, plan, kernel, scale)
    grads = [
        _backward_with(p, *(t[b:b + 1] for t in (dout, q, k, v, out, lse)), pg, kernel, scale,
                       None if kept is None else kept[b])
        for b, p in enumerate(plan)
    ]
    return tuple(torch.cat(g) for g in zip(*grads))


def _on_device_of(t: torch.Tensor):
    """The ring's streams and driver calls act on the current CUDA device: make it t's."""
    if t.device.type == "cuda" and torch.cuda.current_device() != t.device.index:
        return torch.cuda.device(t.device)
    return nullcontext()


# window_left/right: flash-attn's window (-1 = unbounded); cu_seqlens: int tensor of global
# document boundaries or None. Both default to "no window, one document". kv_exchange: "auto",
# "ring" or "allgather" (see schedule.choose_kv_exchange).
@torch.library.custom_op("dtcp::ring_attention_forward", mutates_args=())
def ring_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
    window_left: int = -1, window_right: int = -1, cu_seqlens: Optional[torch.Tensor] = None,
    kv_exchange: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _ = _run_forward(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right,
                               cu_seqlens, kv_exchange)
    return out, lse


@ring_attention_forward.register_fake
def _(q, k, v, group_name, layout, is_causal, scale, backend, window_left=-1, window_right=-1, cu_seqlens=None,
      kv_exchange="auto"):
    # The real op returns fresh contiguous tensors; the fakes must have the same strides.
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dtcp::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
    window_left: int = -1, window_right: int = -1, cu_seqlens: Optional[torch.Tensor] = None,
    kv_exchange: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(dout, q, k, v, out, lse, group_name, layout, is_causal, scale, backend,
                         window_left, window_right, cu_seqlens, kv_exchange)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group_name, layout, is_causal, scale, backend, window_left=-1, window_right=-1,
      cu_seqlens=None, kv_exchange="auto"):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# Defaults of the op's arguments after q, k, v (group_name .. kv_exchange), to fill in what a
# caller left out.
_OP_DEFAULTS = (None, None, None, None, None, -1, -1, None, "auto")


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.num_args = len(args)
    args = list(args) + list(_OP_DEFAULTS[len(args):])
    ctx.save_for_backward(q, k, v, out, lse, args[7])
    ctx.args = tuple(args[:7])
    ctx.kv_exchange = args[8]


def _backward(ctx, dout, dlse):
    # lse is handed to users detached (see api.ring_attention), so dlse carries nothing.
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, *ctx.args, cu_seqlens=cu_seqlens,
                                         kv_exchange=ctx.kv_exchange)
    return (dq, dk, dv) + (None,) * ctx.num_args


ring_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- the compiled route --------------------------------------------------------------------------
# Under torch.compile, calls go through `dtcp::ring_attention`, a CompositeImplicitAutograd op:
# tracing decomposes it, so what it returns decides what the graph holds. Where the all-gather
# schedule applies in traceable form (allgather_traced.traced_reason), the graph gets its
# functional collectives and attention ops, compiled like the rest of the model; everywhere else
# it gets the custom op above, as before. TRACED_ALLGATHER = False keeps every call on the custom
# op; allgather_traced.ONE_LAUNCH = False keeps the traced route at one kernel call per task.
TRACED_ALLGATHER = True

_LIB = torch.library.Library("dtcp", "FRAGMENT")
# `rank`, `world_size` and `route` are arguments although the op could look them up: what the
# decomposition emits depends on them (this rank's kernel calls are constants of its graph), and
# torch.compile's caches (dynamo's, and inductor's and AOT autograd's on disk) key on the graph
# *before* decomposition. With them in the call, each rank, group size, route setting and dtcp
# version has its own cache entry (without them, ranks shared one: wrong results from a warm
# cache, seen on CPU; and a switched route setting silently reused the other route's graph).
_LIB.define(
    "ring_attention(Tensor q, Tensor k, Tensor v, str group_name, str layout, bool is_causal, float scale, "
    "str backend, int window_left, int window_right, Tensor? cu_seqlens, str kv_exchange, int rank, "
    "int world_size, str route) -> (Tensor, Tensor)"
)


def compiled_route_key() -> str:
    """The `route` argument of dtcp::ring_attention: the settings its decomposition reads."""
    from . import __version__  # defined after dtcp/__init__.py imports this module

    if not TRACED_ALLGATHER:
        return f"custom_op;dtcp {__version__}"
    return f"traced{'+one_launch' if allgather_traced.ONE_LAUNCH else ''};dtcp {__version__}"


def _ring_attention_composite(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right,
                              cu_seqlens, kv_exchange, rank, world_size, route):
    if route.startswith("traced") and cu_seqlens is None:
        pg, plan, kernel = prepare(q, k, group_name, layout, is_causal, backend, (window_left, window_right), None,
                                   kv_exchange)
        if (plan.rank, plan.world_size) != (rank, world_size):
            raise RuntimeError(f"dtcp::ring_attention traced for rank {rank} of {world_size} runs on rank "
                               f"{plan.rank} of {plan.world_size}")
        if isinstance(plan, AllGatherPlan) and traced_reason(plan, kernel, q) is None:
            return allgather_attention_traced(q, k, v, pg, plan, kernel, scale)
    return ring_attention_forward(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right,
                                  cu_seqlens, kv_exchange)


_LIB.impl("ring_attention", _ring_attention_composite, "CompositeImplicitAutograd")


# ---- eager fast path ---------------------------------------------------------------------------
# A custom op call costs about 0.4 ms of host time per attention layer (forward + backward,
# measured on the H200 hosts at torchtitan's debug-model shapes, where the whole ring step is
# ~2 ms of host time). Outside torch.compile, with plain tensors and no dispatch mode or functorch
# transform active, the same ring runs through this autograd.Function instead; everything else
# (tracing, fake tensors, subclasses, modes, vmap) goes through the custom op. Both call
# prepare/ring_forward/ring_backward with the same arguments, so the results are identical.
EAGER_FAST_PATH = True


class _RingAttentionEager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, *args):
        # When a backward will follow, keep the all-gather schedule's gathered K/V for it (one
        # collective and its reordering fewer per layer; see allgather.py for the memory).
        out, lse, kept = _run_forward(q, k, v, *args, keep=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kept = kept
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # released as soon as it is used
        return _run_backward(dout, q, k, v, out, lse, *ctx.args, kept=kept) + (None,) * len(ctx.args)


def ring_attention_eager_or_op(q, k, v, *args, rank: int = 0, world_size: int = 1):
    """ring_attention_forward's (out, lse): under torch.compile through the compiled route, in
    plain eager calls through the eager fast path, else (fake tensors, modes, subclasses, vmap)
    through the custom op. `args` are all of the op's arguments after q, k, v (group_name ..
    kv_exchange); rank and world_size are this process's in the group (the compiled route's)."""
    if torch.compiler.is_compiling():
        return torch.ops.dtcp.ring_attention(q, k, v, *args, rank, world_size, compiled_route_key())
    if EAGER_FAST_PATH and _compat.plain_eager_call(q, k, v, args[7]):
        return _RingAttentionEager.apply(q, k, v, *args)
    return ring_attention_forward(q, k, v, *args)
