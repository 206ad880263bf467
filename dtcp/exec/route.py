"""Routes: what one call runs (exchange, plan, kernel, transport), and running it safely.

A call's *signature* is everything that decides what it computes: shapes, dtype, device, layout,
mask (causal, window, `cu_seqlens` values), scale, requested exchange and backend, group. The
first time a rank meets a signature it builds the route locally (plans for every rank, the
exchange, a kernel that serves every rank's tasks; no communication) and then the ranks *agree*
on it (dtcp/comm/guard.py): different arguments, or an error on any rank, raise on every rank
before any data moves. Routes are cached per group by signature value, so nothing in a key can
change behind dtcp's back: `cu_seqlens` values are read once per call, where the call happens.

`run_forward` / `run_backward` dispatch on the plan type. Any failure inside them marks the group
failed and tells the other ranks (their bounded waits end with PeerFailedError/PeerTimeoutError),
and this rank re-raises its own error.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import _compat
from ..comm import GroupState, on_device_of, state_of
from ..comm.groups import all_states
from ..comm.copy_engine import copy_engine_ring
from ..comm.guard import digest
from ..comm.p2p import RingComm
from ..config import config
from ..errors import DtcpError, PeerFailedError, PeerTimeoutError
from ..kernels import Kernel, acc_dtype, select_kernel
from ..layouts import DocZigzag, Layout, layout_from_spec
from ..plan import (
    AllGatherPlan, AttnMask, RingPlan, VarlenPlan, allgather_plans, exchange_candidates, ring_plans,
    row_cu_seqlens, segments_from_cu_seqlens, varlen_reason,
)
from .allgather import allgather_backward, allgather_forward, varlen_backward, varlen_forward
from .ring import ring_backward, ring_forward

_MAX_ROUTES = 256  # per group; a training loop with a new document structure every batch cycles through


@dataclass(frozen=True)
class CallArgs:
    """The op's non-tensor arguments, by name (dtcp/ops.py passes them in this order)."""

    group_name: str
    layout: str
    is_causal: bool
    scale: float
    backend: str
    window_left: int
    window_right: int
    kv_exchange: str
    softcap: float = 0.0  # 0: none

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)

    @property
    def softcap_or_none(self) -> Optional[float]:
        return self.softcap if self.softcap > 0 else None


Plan = Union[RingPlan, AllGatherPlan, VarlenPlan, tuple]


class Route:
    """One signature's exchange, this rank's plan and the kernel (the same kernel on every rank)."""

    def __init__(self, state: GroupState, exchange: str, plan: Plan, kernel: Kernel, signature: dict,
                 softcap: Optional[float]):
        self.state, self.exchange, self.plan, self.kernel = state, exchange, plan, kernel
        self.signature, self.softcap = signature, softcap

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.size

    def comm_group(self):
        return self.state.comm_group()

    def ring_comm(self, q: torch.Tensor, k: torch.Tensor, backward: bool) -> RingComm:
        """The ring's exchange on q's device, its copy-engine slots sized for this route's K/V (and,
        for a backward, float32 dK/dV) before the first exchange. Collective on first use."""
        state, device = self.state, q.device
        comm = state.rings.get(device)
        if comm is None:
            comm = state.rings[device] = RingComm(state, device, copy_engine_ring(state, device))
        if comm.copy_engine is not None:  # (no-ops once the slots are large enough)
            comm.copy_engine.ensure("kv", 2 * _aligned_nbytes(k))
            if backward:
                comm.copy_engine.ensure("grad", 2 * _aligned_nbytes(k, acc_dtype(k.dtype)))
        return comm


def _aligned_nbytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    size = t.numel() * (t.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
    return (size + 255) // 256 * 256


# ---- building and agreeing ---------------------------------------------------------------------
def route_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: CallArgs,
              cu_values: Optional[tuple[int, ...]], what: str, sinks: Optional[torch.Tensor] = None) -> Route:
    """The cached route of this call's signature, built and agreed on first use. `sinks` matter
    by presence and shape only (their values are parameters, like q's)."""
    state = state_of(_compat.group_from_name(args.group_name))
    state.guard.check_healthy()
    sinks_shape = None if sinks is None else tuple(sinks.shape)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, args.layout, args.is_causal,
           args.scale, args.window, cu_values, args.kv_exchange, args.backend, args.softcap, sinks_shape)
    routes = _routes_of(state)
    route = routes.get(key)
    if route is not None:
        routes.move_to_end(key)
        if config.check_every_call:
            state.guard.agree(what, route.signature)
        return route
    signature = _signature(q, k, v, args, cu_values, state.size, sinks_shape)
    try:
        exchange, plan, kernel = _build(q, k, v, args, cu_values, state, sinks is not None)
    except (ValueError, TypeError) as e:
        state.guard.agree(what, signature, status=f"{type(e).__name__}: {e}")  # tell the others, then raise
        raise
    state.guard.agree(what, signature)
    route = routes[key] = Route(state, exchange, plan, kernel, signature, args.softcap_or_none)
    if len(routes) > _MAX_ROUTES:
        routes.popitem(last=False)
    return route


def clear_routes() -> None:
    """Forget every group's routes (tests and benchmarks that change a kernel's behaviour between
    calls). Call it on every rank at the same point: the next calls agree again."""
    for state in all_states():
        _routes_of(state).clear()


def _routes_of(state: GroupState) -> "OrderedDict":
    routes = getattr(state, "routes", None)
    if routes is None:
        routes = state.routes = OrderedDict()
    return routes


def _signature(q, k, v, args: CallArgs, cu_values, world_size: int, sinks_shape) -> dict[str, str]:
    """What must be equal on every rank, as strings (the agreement's fields)."""
    return {
        "world size": str(world_size),
        "q.shape": str(tuple(q.shape)), "k.shape": str(tuple(k.shape)), "v.shape": str(tuple(v.shape)),
        "dtype": str(q.dtype), "device type": q.device.type, "layout": args.layout,
        "is_causal": str(args.is_causal), "scale": repr(args.scale), "window_size": str(args.window),
        "cu_seqlens": digest(cu_values), "kv_exchange": args.kv_exchange, "backend": args.backend,
        "softcap": repr(args.softcap), "sinks": str(sinks_shape),
    }


def _build(q, k, v, args: CallArgs, cu_values, state: GroupState, sinks: bool):
    """(exchange, this rank's plan, kernel): local and deterministic, so every rank that agrees on
    the signature builds the same (kernel choice looks at every rank's tasks)."""
    n, r = state.size, state.rank
    local_len, batch = q.shape[2], q.shape[0]
    seq_len = local_len * n
    if args.layout == "doczigzag":  # the layout's documents travel as cu_seqlens (see DocZigzag)
        layout: Layout = DocZigzag.from_cu_seqlens(cu_values)
        layout.check(seq_len, n)
        row_segments = (layout.segments(n),) * batch
    else:
        layout = layout_from_spec(args.layout)
        layout.check(seq_len, n)
        if cu_values is None:
            row_segments = (None,) * batch
        else:
            row_segments = tuple(segments_from_cu_seqlens(c, seq_len) for c in row_cu_seqlens(cu_values, batch, seq_len))
    gathered_kv_bytes = 2 * k.numel() * k.element_size() * n
    candidates = exchange_candidates(args.kv_exchange, layout, local_len, n, q.device.type, gathered_kv_bytes,
                                     config.allgather_max_bytes)
    error = None
    for exchange in candidates:
        try:
            return (exchange,) + _plan_and_kernel(exchange, layout, q, k, v, args, row_segments, n, r, sinks)
        except ValueError as e:  # e.g. the named kernel cannot serve this schedule: try the next
            error = e
    raise error


def _plan_and_kernel(exchange, layout, q, k, v, args: CallArgs, row_segments, n: int, r: int, sinks: bool):
    """(this rank's plan, kernel) for one exchange, or ValueError. The ring adds attention sinks
    itself, once per row after merging, so any kernel serves it; under the all-gather schedule each
    row is one kernel call and the kernel adds them."""
    local_len = q.shape[2]
    features = dict(v=v, softcap=args.softcap_or_none, sinks=sinks and exchange == "allgather")
    distinct = list(dict.fromkeys(row_segments))
    masks = {seg: AttnMask.make(args.is_causal, args.window, seg) for seg in distinct}
    build = allgather_plans if exchange == "allgather" else ring_plans
    row_plans = {seg: build(layout, local_len, n, args.is_causal, masks[seg]) for seg in distinct}
    all_tasks = [t for plans in row_plans.values() for plan in plans for t in plan.tasks]
    per_row = len(distinct) > 1
    if exchange == "allgather" and distinct != [None] and k.shape == v.shape:
        # Documents under the all-gather schedule: one varlen call for the whole batch where a
        # kernel takes it in one launch, and for rows with their own documents (instead of a loop
        # over rows) with any kernel that takes varlen calls.
        window = masks[distinct[0]].band.window
        rank_plans = [VarlenPlan(tuple(row_plans[seg][rr] for seg in row_segments), window) for rr in range(n)]
        if all(p.rows_tiled for p in rank_plans) and varlen_reason(all_tasks, window) is None:
            seq_lens = [sl for p in rank_plans for sl in p.seq_lens]
            try:
                kernel = select_kernel(args.backend, q, k, all_tasks, varlen=(seq_lens, window), **features)
            except ValueError:
                kernel = None
            if kernel is not None and (per_row or kernel.varlen_one_launch):
                return rank_plans[r], kernel
    kernel = select_kernel(args.backend, q, k, all_tasks, **features)
    if per_row:
        return tuple(row_plans[seg][r] for seg in row_segments), kernel
    return row_plans[distinct[0]][r], kernel


# ---- running -------------------------------------------------------------------------------------
def run_forward(route: Route, q, k, v, scale: float, keep_gathered_kv: bool = False,
                sinks: Optional[torch.Tensor] = None):
    """(out, lse, gathered_kv): with `keep_gathered_kv`, the all-gather schedule's gathered K/V for
    the backward to reuse (None for the ring). With `sinks` (Hq,), lse includes them."""
    with on_device_of(q), _failures(route, "forward"):
        comm = route.ring_comm(q, k, backward=False) if _has_ring(route.plan) else None
        sink = None if sinks is None else sinks.detach().to(acc_dtype(q.dtype))
        result = _forward(route, route.plan, q, k, v, scale, keep_gathered_kv, comm, sink)
        _end_of_call(route, q)
        return result


def run_backward(route: Route, dout, q, k, v, out, lse, scale: float, gathered_kv=None,
                 sinks: Optional[torch.Tensor] = None):
    """(dq, dk, dv, dsinks) given the forward's final out and lse; `gathered_kv`: what run_forward
    kept, or None to gather again. dsinks (this rank's rows' share, like every parameter's
    gradient under context parallelism) is None without sinks."""
    with on_device_of(q), _failures(route, "backward"):
        comm = route.ring_comm(q, k, backward=True) if _has_ring(route.plan) else None
        dq, dk, dv = _backward(route, route.plan, dout, q, k, v, out, lse, scale, gathered_kv, comm)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        _end_of_call(route, q)
        return dq, dk, dv, dsinks


def sink_grad(dout, out, lse, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks[h] = -sum over rows of P(sink) * rowsum(dout * out), with P(sink) =
    exp(sinks[h] - lse) the sink column's probability (its value is zero, so only the softmax's
    normalisation carries it). Rows that see no key have out 0: they add nothing."""
    acc = acc_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, L)
    p_sink = torch.exp(sinks.detach().to(acc)[None, :, None] - lse.to(acc))
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)


def _end_of_call(route: Route, q: torch.Tensor) -> None:
    # On CUDA the waits for peers are on the GPU: this check stops the stream if the group failed
    # while it was blocked (dtcp/comm/watchdog.py) instead of letting a result computed from
    # released buffers through. One tiny kernel per call; no check where nothing was exchanged.
    if q.device.type == "cuda" and route.world_size > 1:
        route.state.assert_healthy(q.device)


def _has_ring(plan) -> bool:
    if isinstance(plan, tuple):
        return any(_has_ring(p) for p in plan)
    return isinstance(plan, RingPlan) and plan.num_rounds > 0


def _forward(route, plan, q, k, v, scale, keep_gathered_kv, comm, sink):
    options = dict(softcap=route.softcap, sink=sink)
    if isinstance(plan, VarlenPlan):
        return varlen_forward(q, k, v, route.comm_group(), plan, route.kernel, scale, keep_kv=keep_gathered_kv,
                              **options)
    if isinstance(plan, AllGatherPlan):
        return allgather_forward(q, k, v, route.comm_group(), plan, route.kernel, scale, keep_kv=keep_gathered_kv,
                                 **options)
    if isinstance(plan, RingPlan):
        return ring_forward(q, k, v, plan, route.kernel, scale, comm or _LOCAL, **options) + (None,)
    # one plan per batch row (rows with their own documents, no varlen kernel): a call per row,
    # the same calls in the same order on every rank
    rows = [_forward(route, p, q[b:b + 1], k[b:b + 1], v[b:b + 1], scale, keep_gathered_kv, comm, sink)
            for b, p in enumerate(plan)]
    return (torch.cat([o for o, _, _ in rows]), torch.cat([lse for _, lse, _ in rows]),
            [kv for _, _, kv in rows] if keep_gathered_kv else None)


def _backward(route, plan, dout, q, k, v, out, lse, scale, gathered_kv, comm):
    if isinstance(plan, VarlenPlan):
        return varlen_backward(dout, q, k, v, out, lse, route.comm_group(), plan, route.kernel, scale, kv=gathered_kv,
                               softcap=route.softcap)
    if isinstance(plan, AllGatherPlan):
        return allgather_backward(dout, q, k, v, out, lse, route.comm_group(), plan, route.kernel, scale,
                                  kv=gathered_kv, softcap=route.softcap)
    if isinstance(plan, RingPlan):
        return ring_backward(dout, q, k, v, out, lse, plan, route.kernel, scale, comm or _LOCAL, softcap=route.softcap)
    grads = [
        _backward(route, p, *(t[b:b + 1] for t in (dout, q, k, v, out, lse)), scale,
                  None if gathered_kv is None else gathered_kv[b], comm)
        for b, p in enumerate(plan)
    ]
    return tuple(torch.cat(g) for g in zip(*grads))


class _LocalOnly:
    """The 'exchange' of a plan with no rounds (one rank, or every needed block local)."""

    @staticmethod
    def spare_buffers(like, kind):  # pragma: no cover - a plan without rounds asks for none
        raise AssertionError("a ring plan without rounds exchanges nothing")

    @staticmethod
    def finish() -> None:
        pass

    drain = finish


_LOCAL = _LocalOnly()


@contextlib.contextmanager
def _failures(route: Route, what: str):
    """Turn any failure inside a call into an error on every rank (see the module docstring)."""
    guard = route.state.guard
    try:
        yield
    except DtcpError:
        raise
    except Exception as e:
        own = f"rank {route.rank}: {what} failed: {type(e).__name__}: {e}"
        peer = guard.peer_failure()
        guard.fail(own if peer is None else f"{peer} (and on rank {route.rank}: {type(e).__name__})")
        if peer is not None:
            raise PeerFailedError(f"dtcp {what} on rank {route.rank}: another rank failed first: {peer}") from e
        if _is_timeout(e):
            raise PeerTimeoutError(
                f"dtcp {what} on rank {route.rank}: waited longer than dtcp.config.timeout_s = {config.timeout_s:g} s "
                f"for another rank of process group {route.state.name!r} ({e}). The other ranks failed, or are "
                "making other calls; raise dtcp.config.timeout_s if ranks legitimately drift apart that far"
            ) from e
        if _is_peer_gone(e):
            raise PeerFailedError(
                f"dtcp {what} on rank {route.rank}: another rank of process group {route.state.name!r} failed or "
                f"exited during the call ({e})"
            ) from e
        raise


def _is_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _is_peer_gone(e: Exception) -> bool:
    text = str(e).lower()
    return "connection closed by peer" in text or "connection reset" in text or "pair closure" in text
