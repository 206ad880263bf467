"""`torch.library` ops around the executors: definitions, fake implementations and autograd, so
that `torch.compile(fullgraph=True)` traces callers without graph breaks.

Three ways a call runs (`attention` picks):
* **compiled** (under torch.compile): `dtcp::ring_attention`, a CompositeImplicitAutograd op that
  tracing decomposes. Where the all-gather schedule applies in traceable form (static shapes, no
  documents, a traceable kernel: dtcp/exec/traced.py) the graph gets its functional collectives and
  attention ops; everywhere else (the ring, windows, documents, dynamic shapes) it gets the custom
  op `dtcp::ring_attention_forward`, whose communication and kernels run inside, opaque to the
  compiler, which keeps the transfer/compute overlap intact.
* **eager fast path** (plain tensors, no mode or transform active): an autograd.Function that calls
  the same executors (a custom op call costs ~0.4 ms of host time per layer at small shapes).
* **custom op** (fake tensors, subclasses, modes, vmap): `dtcp::ring_attention_forward` /
  `_backward` directly.

All three read `cu_seqlens` values once per call and give identical results. The process group
travels by name, the layout by its spec string.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import types
import warnings
from typing import Optional

import torch

from . import _compat
from .config import config
from .exec.route import CallArgs, route_for, run_backward, run_forward
from .exec.traced import allgather_attention_traced, traced_reason
from .kernels import acc_dtype
from .plan import AllGatherPlan

_TAGS = _compat.cudagraph_unsafe_tags()


def _cu_values(cu_seqlens: Optional[torch.Tensor]) -> Optional[tuple[int, ...]]:
    """The boundaries' current values, read here, once per call (a CUDA tensor costs one device
    synchronisation: pass CPU boundaries to avoid it)."""
    return None if cu_seqlens is None else tuple(cu_seqlens.tolist())


# window_left/right: flash-attn's window (-1 = unbounded); cu_seqlens: int tensor of global
# document boundaries or None. strategy: "auto", "ring", "allgather", "ulysses" or "hybrid"
# (dtcp/plan/exchange.py). softcap: tanh capping of the scores (0: none); sinks: (Hq,) attention-sink
# logits or None. head_group_name: the Ulysses dim's group of a 2-D mesh ("" for a 1-D group).
# chunk_size: chunked attention, within chunks of this many tokens of each document (0: none).
# route: compile-cache key only (compiled_route_key(); "" outside torch.compile), not read.
def _forward_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
    window_left: int = -1, window_right: int = -1, cu_seqlens: Optional[torch.Tensor] = None,
    strategy: str = "auto", softcap: float = 0.0, sinks: Optional[torch.Tensor] = None, head_group_name: str = "",
    chunk_size: int = 0, route: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    args = CallArgs(group_name, layout, is_causal, scale, backend, window_left, window_right, strategy, softcap,
                    head_group_name, chunk_size)
    route = route_for(q, k, v, args, _cu_values(cu_seqlens), "dtcp.ring_attention forward", sinks)
    out, lse, _ = run_forward(route, q, k, v, scale, sinks=sinks)
    return out, lse


ring_attention_forward = torch.library.custom_op("dtcp::ring_attention_forward", _forward_impl, mutates_args=(),
                                                 tags=_TAGS)


@ring_attention_forward.register_fake
def _(q, k, v, group_name, layout, is_causal, scale, backend, window_left=-1, window_right=-1, cu_seqlens=None,
      strategy="auto", softcap=0.0, sinks=None, head_group_name="", chunk_size=0, route=""):
    # The real op returns fresh contiguous tensors; the fakes must have the same strides.
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("dtcp::ring_attention_backward", mutates_args=(), tags=_TAGS)
def ring_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    group_name: str, layout: str, is_causal: bool, scale: float, backend: str,
    window_left: int = -1, window_right: int = -1, cu_seqlens: Optional[torch.Tensor] = None,
    strategy: str = "auto", softcap: float = 0.0, sinks: Optional[torch.Tensor] = None, head_group_name: str = "",
    chunk_size: int = 0, route: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty without sinks."""
    args = CallArgs(group_name, layout, is_causal, scale, backend, window_left, window_right, strategy, softcap,
                    head_group_name, chunk_size)
    route = route_for(q, k, v, args, _cu_values(cu_seqlens), "dtcp.ring_attention backward", sinks)
    dq, dk, dv, dsinks = run_backward(route, dout, q, k, v, out, lse, scale, sinks=sinks)
    return dq, dk, dv, (q.new_empty(0) if dsinks is None else dsinks)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group_name, layout, is_causal, scale, backend, window_left=-1, window_right=-1,
      cu_seqlens=None, strategy="auto", softcap=0.0, sinks=None, head_group_name="", chunk_size=0, route=""):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


# The forward op's arguments by name (defaults filled in), whatever the caller left out.
_FORWARD_SIGNATURE = inspect.signature(_forward_impl)
_OP_ARG_NAMES = tuple(_FORWARD_SIGNATURE.parameters)[3:]


def _setup_context(ctx, inputs, output):
    bound = _FORWARD_SIGNATURE.bind(*inputs)
    bound.apply_defaults()
    named = bound.arguments
    out, lse = output
    cu = named["cu_seqlens"]
    # A private copy: a boundaries buffer the caller rewrites before the backward (a reused loader
    # buffer) must not change the backward's mask.
    ctx.save_for_backward(named["q"], named["k"], named["v"], out, lse, None if cu is None else cu.clone(),
                          named["sinks"])
    ctx.args = {name: named[name] for name in _OP_ARG_NAMES if name not in ("cu_seqlens", "sinks")}
    ctx.num_args = len(inputs) - 3
    ctx.sinks_at = _OP_ARG_NAMES.index("sinks") if len(inputs) - 3 > _OP_ARG_NAMES.index("sinks") else None


def _backward(ctx, dout, dlse):
    # lse is handed to users detached (see api.ring_attention), so dlse carries nothing.
    q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = ring_attention_backward(dout, q, k, v, out, lse, cu_seqlens=cu_seqlens, sinks=sinks,
                                                 **ctx.args)
    grads = [None] * ctx.num_args
    if sinks is not None:
        grads[ctx.sinks_at] = dsinks
    return (dq, dk, dv, *grads)


ring_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- the compiled route --------------------------------------------------------------------------
_LIB = torch.library.Library("dtcp", "FRAGMENT")
# `rank`, `world_size` and `route` are arguments although the op could look them up: what the
# decomposition emits depends on them (this rank's kernel calls are constants of its graph), and
# torch.compile's caches (dynamo's, and inductor's and AOT autograd's on disk) key on the graph
# *before* decomposition. With them in the call, each rank, group size, route setting and version
# of dtcp's source has its own cache entry.
_LIB.define(
    "ring_attention(Tensor q, Tensor k, Tensor v, str group_name, str layout, bool is_causal, float scale, "
    "str backend, int window_left, int window_right, Tensor? cu_seqlens, str strategy, float softcap, "
    "Tensor? sinks, str head_group_name, int chunk_size, int rank, int world_size, str route) -> (Tensor, Tensor)"
)


def _source_digest(root: Optional[str] = None) -> str:
    """A digest of dtcp's source files (the package at `root`, by default this one): the compiled
    route key changes whenever the code that the decomposition runs changes, not only when the
    version string does."""
    root = root or os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha1()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


SOURCE_DIGEST = _source_digest()


def compiled_route_key() -> str:
    """The `route` argument of dtcp::ring_attention: the settings its decomposition reads, and the
    digest of the source that reads them. Read while tracing, so torch.compile guards on them: a
    change re-traces. The traced all-gather is chosen while tracing (strategy="auto"'s pick), so
    the cost objective and the layer's FLOPs per token are among them (config.cost_text);
    `dtcp.config.cost_machine` is not (a Machine has no stable short form): calibrate before
    compiling."""
    if not config.traced_allgather:
        return f"custom_op;src {SOURCE_DIGEST}"
    return f"traced{'+one_launch' if config.one_launch else ''};cost {config.cost_text};src {SOURCE_DIGEST}"


def _ring_attention_composite(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right,
                              cu_seqlens, strategy, softcap, sinks, head_group_name, chunk_size, rank, world_size,
                              route):
    # Symbolic shapes (dynamic sequence lengths, batch sizes) take the custom op: its real
    # implementation sees concrete shapes at run time, and no plan or cache key holds a SymInt.
    # Softcap, sinks, chunks and a value head dim of its own have no traced form either.
    plain = (cu_seqlens is None and softcap == 0.0 and sinks is None and v.shape[-1] == q.shape[-1]
             and strategy in ("auto", "ring", "allgather") and not head_group_name and not chunk_size)
    if route.startswith("traced") and plain and _compat.all_concrete(q.shape, k.shape, v.shape):
        args = CallArgs(group_name, layout, is_causal, scale, backend, window_left, window_right, strategy)
        planned = route_for(q, k, v, args, None, "dtcp.ring_attention (compiled)")
        if (planned.rank, planned.world_size) != (rank, world_size):
            raise RuntimeError(f"dtcp::ring_attention traced for rank {rank} of {world_size} runs on rank "
                               f"{planned.rank} of {planned.world_size}")
        if (planned.heads is None and isinstance(planned.plan, AllGatherPlan)
                and traced_reason(planned.plan, planned.kernel, q) is None):
            return allgather_attention_traced(q, k, v, planned.comm_group(), planned.plan, planned.kernel, scale)
    # `route` also reaches the custom op: inductor's graph cache keys on the graph *after* this
    # decomposition, where an op call with the same positional values but another schema (an
    # older dtcp) would otherwise hit the cache and run code generated for the old schema.
    return ring_attention_forward(q, k, v, group_name, layout, is_causal, scale, backend, window_left, window_right,
                                  cu_seqlens, strategy, softcap, sinks, head_group_name, chunk_size, route)


_LIB.impl("ring_attention", _ring_attention_composite, "CompositeImplicitAutograd")


# ---- eager fast path ---------------------------------------------------------------------------
class _AttentionEager(torch.autograd.Function):
    """The custom op's forward and backward without the op's dispatch (see the module docstring).
    The backward runs the forward's own route: the same plan even if `cu_seqlens` changed since."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, args: CallArgs, cu_seqlens):
        route = route_for(q, k, v, args, _cu_values(cu_seqlens), "dtcp.ring_attention forward", sinks)
        # When a backward will follow, keep the all-gather schedule's gathered K/V for it (one
        # collective and its reordering fewer per layer; dtcp/exec/allgather.py for the memory).
        out, lse, gathered_kv = run_forward(route, q, k, v, args.scale,
                                            keep_gathered_kv=any(ctx.needs_input_grad[:3]), sinks=sinks)
        if route.heads is not None and gathered_kv is not None:
            # A head exchange keeps its exchanged tensors instead (the same memory): the backward
            # then exchanges only dout out and the gradients back.
            ctx.save_for_backward(None, None, None, None, None, sinks)
        else:
            ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.route, ctx.gathered_kv, ctx.scale = route, gathered_kv, args.scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        gathered_kv = ctx.gathered_kv
        if ctx.route.heads is None:
            ctx.gathered_kv = None  # released as soon as it is used (the saved q, k, v can gather again)
        # (a head exchange's kept tensors stand in for the saved q, k, v, out, lse: they live as
        # long as the graph, so that a second backward with retain_graph=True works too)
        dq, dk, dv, dsinks = run_backward(ctx.route, dout, q, k, v, out, lse, ctx.scale, gathered_kv=gathered_kv,
                                          sinks=sinks)
        return dq, dk, dv, dsinks, None, None


def attention(q, k, v, args: CallArgs, cu_seqlens: Optional[torch.Tensor], rank: int, world_size: int,
              sinks: Optional[torch.Tensor] = None):
    """(out, lse) of one call: compiled route, eager fast path or custom op (module docstring)."""
    op_args = (args.group_name, args.layout, args.is_causal, args.scale, args.backend, args.window_left,
               args.window_right, cu_seqlens, args.strategy, args.softcap, sinks, args.head_group_name,
               args.chunk_size)
    if torch.compiler.is_compiling():
        return torch.ops.dtcp.ring_attention(q, k, v, *op_args, rank, world_size, compiled_route_key())
    plain_sinks = sinks is None or type(sinks) in (torch.Tensor, torch.nn.Parameter)  # sinks are parameters
    if config.eager_fast_path and plain_sinks and _compat.plain_eager_call(q, k, v, cu_seqlens):
        return _AttentionEager.apply(q, k, v, sinks, args, cu_seqlens)
    return ring_attention_forward(q, k, v, *op_args)


# ---- switches that moved to dtcp.config -----------------------------------------------------------
class _OpsModule(types.ModuleType):
    """dtcp.ops.TRACED_ALLGATHER and dtcp.ops.EAGER_FAST_PATH (dtcp 0.1) still work, with a
    DeprecationWarning: they read and set dtcp.config.traced_allgather / eager_fast_path."""

    _MOVED = {"TRACED_ALLGATHER": "traced_allgather", "EAGER_FAST_PATH": "eager_fast_path"}

    def __getattr__(self, name):
        if name in _OpsModule._MOVED:
            warnings.warn(f"dtcp.ops.{name} is deprecated: use dtcp.config.{_OpsModule._MOVED[name]}",
                          DeprecationWarning, stacklevel=2)
            return getattr(config, _OpsModule._MOVED[name])
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in _OpsModule._MOVED:
            warnings.warn(f"dtcp.ops.{name} is deprecated: set dtcp.config.{_OpsModule._MOVED[name]}",
                          DeprecationWarning, stacklevel=2)
            setattr(config, _OpsModule._MOVED[name], value)
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _OpsModule
