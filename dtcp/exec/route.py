"""Routes: what one call runs (strategy, plans, kernel, transport), and running it safely.

A call's *signature* is everything that decides what it computes: shapes, dtype, device, layout,
mask (causal, window, `cu_seqlens` values), scale, requested strategy and backend, groups. The
first time a rank meets a signature it builds the route locally (plans for every rank, the
exchange, a kernel that serves every rank's tasks; no communication) and then the ranks *agree*
on it (dtcp/comm/guard.py): different arguments, or an error on any rank, raise on every rank
before any data moves. Routes are cached per group by signature value, so nothing in a key can
change behind dtcp's back: `cu_seqlens` values are read once per call, where the call happens.

Strategies (`Route.strategy`): "ring" and "allgather" move K/V over the call's group; "ulysses"
exchanges heads for tokens over the group (exec/ulysses.py) and runs local attention over the whole
sequence; "hybrid" exchanges heads over the Ulysses group of a 2-D mesh and runs the ring (or
all-gather) across the Ulysses groups. Every strategy ends in the same per-exchange executors:
`Route.exchange` and `Route.plan` describe the attention after any head exchange.

`run_forward` / `run_backward` dispatch on the plan type. Any failure inside them marks the groups
failed and tells the other ranks (their bounded waits end with PeerFailedError/PeerTimeoutError),
and this rank re-raises its own error.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
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
from ..kernels import Kernel, Target, acc_dtype, select_kernel
from ..layouts import Balanced, DocZigzag, Layout, layout_from_spec
from ..layouts.balanced import balanced_options
from ..plan import (
    AllGatherPlan, AttnMask, CallShape, Prediction, RingPlan, UlyssesPlan, VarlenPlan, allgather_plans,
    allgather_reason, chunk_segments, exchange_candidates, head_splits, inner_layout, plan_pairs, ring_plans,
    row_cu_seqlens,
    segments_from_cu_seqlens, ulysses_plan, varlen_plans, varlen_reason,
)
from ..plan.cost import machine_for, predict, rank as rank_strategies
from ..plan.fuse import accumulator_traffic, fused_launches, plan_launches
from ..plan.group import group_launches
from .allgather import allgather_backward, allgather_forward, varlen_backward, varlen_forward
from .grouped import grouped, grouped_backward, grouped_forward
from .fused import fuses, takes_gaps
from .ring import ring_backward, ring_forward
from .ulysses import to_heads, to_sequence

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
    strategy: str
    softcap: float = 0.0  # 0: none
    head_group_name: str = ""  # the Ulysses group of a 2-D mesh ("": the call's group is 1-D)
    chunk_size: int = 0  # chunked attention: within chunks of this many tokens of each document (0: none)

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)

    @property
    def softcap_or_none(self) -> Optional[float]:
        return self.softcap if self.softcap > 0 else None


Plan = Union[RingPlan, AllGatherPlan, VarlenPlan, tuple]


class Route:
    """One signature's strategy, plans and kernel (the same kernel on every rank).

    `state` is the call's group (for a 2-D mesh, its ring dim). `head_state` is the group heads
    are exchanged over (None for "ring" and "allgather"; the call's group for "ulysses"; the
    Ulysses dim for "hybrid"), `heads` this rank's head exchange. `exchange` and `plan` are the
    attention after it, over `seq_state` (None when that is one rank: "ulysses")."""

    def __init__(self, state: GroupState, head_state: Optional[GroupState], strategy: str, exchange: str,
                 heads: Optional[UlyssesPlan], plan: Plan, kernel: Kernel, signature: dict, softcap: Optional[float],
                 steps_per_launch: int = 1):
        self.state, self.head_state, self.strategy, self.exchange = state, head_state, strategy, exchange
        self.heads, self.plan, self.kernel = heads, plan, kernel
        # the ring's received blocks per launch (exec/grouped.py; 1: step by step): the setting, or
        # the cost model's choice for this call (`ring_steps`), the same on every rank
        self.steps_per_launch = steps_per_launch
        self.signature, self.softcap = signature, softcap
        self.seq_state = None if strategy == "ulysses" else state

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.size

    @property
    def states(self) -> list[GroupState]:
        """Every group this route communicates over."""
        return [self.state] if self.head_state in (None, self.state) else [self.head_state, self.state]

    @property
    def agreement_states(self) -> list[GroupState]:
        return [self.state] if self.strategy != "hybrid" else [self.head_state, self.state]

    def comm_group(self):
        """dtcp's group for the attention after the head exchange (None: one rank, nothing to move)."""
        return None if self.seq_state is None else self.seq_state.comm_group()

    def head_comm_group(self):
        return self.head_state.comm_group()

    def ring_comm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> RingComm:
        """The ring's exchange on q's device, its copy-engine slots sized for this route's K and V
        (and, for a backward, float32 dK/dV) before the first exchange. Collective on first use."""
        state, device = self.seq_state, q.device
        comm = state.rings.get(device)
        if comm is None:
            comm = state.rings[device] = RingComm(state, device, copy_engine_ring(state, device))
        if comm.copy_engine is not None:  # (no-ops once the slots are large enough)
            # K and V each (a value head dim of its own makes V larger or smaller than K)
            comm.copy_engine.ensure("kv", _aligned_nbytes(k) + _aligned_nbytes(v))
            if backward:
                acc = acc_dtype(k.dtype)
                comm.copy_engine.ensure("grad", _aligned_nbytes(k, acc) + _aligned_nbytes(v, acc))
        return comm


def _aligned_nbytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    size = t.numel() * (dtype or t.dtype).itemsize
    return (size + 255) // 256 * 256


# ---- building and agreeing ---------------------------------------------------------------------
def route_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: CallArgs,
              cu_values: Optional[tuple[int, ...]], what: str, sinks: Optional[torch.Tensor] = None) -> Route:
    """The cached route of this call's signature, built and agreed on first use. `sinks` matter
    by presence and shape only (their values are parameters, like q's)."""
    state = state_of(_compat.group_from_name(args.group_name))
    head_state = state_of(_compat.group_from_name(args.head_group_name)) if args.head_group_name else None
    for s in (state, head_state):
        if s is not None:
            s.guard.check_healthy()
    sinks_shape = None if sinks is None else tuple(sinks.shape)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, args.layout, args.is_causal,
           args.scale, args.window, cu_values, args.strategy, args.backend, args.softcap, sinks_shape,
           args.head_group_name, args.chunk_size, config.ring_steps_per_launch, config.cost_machine,
           config.cost_objective, config.layer_flops_per_token,
           config.allgather_exchange)  # (auto's picks and the plans follow them: new value, new route)
    routes = _routes_of(state)
    route = routes.get(key)
    if route is not None and route.head_state is (head_state or route.head_state):
        routes.move_to_end(key)
        if config.check_every_call:
            _agree(route.agreement_states, what, route.signature)
        return route
    signature = _signature(q, k, v, args, cu_values, state, head_state, sinks_shape)
    guards = [state] if head_state is None else [head_state, state]  # the same order on every rank
    try:
        strategy, exchange, heads, plan, kernel, size = _build(q, k, v, args, cu_values, state, head_state,
                                                               sinks is not None)
    except (ValueError, TypeError) as e:
        for s in guards:  # tell the others, then raise
            s.guard.agree(what, signature, status=f"{type(e).__name__}: {e}")
        raise
    # What the build chose from the cost model (strategy="auto", ring_steps_per_launch="auto") must
    # be the same on every rank too: ranks whose constants or objective differ (dtcp.config.cost_machine
    # or cost_objective set on some ranks only) would otherwise run different schedules and wait on
    # each other.
    signature = dict(signature, **{
        "strategy chosen (dtcp.config.cost_machine, cost_objective, layer_flops_per_token)": strategy,
        "ring steps per launch (dtcp.config.ring_steps_per_launch, cost_machine, cost_objective, "
        "layer_flops_per_token)": str(size),
        # (an all-to-all of the keys read on some ranks, an all-gather on others, would never meet)
        "all-gather moving only the keys other ranks read (dtcp.config.allgather_exchange)":
            str(isinstance(plan, VarlenPlan) and plan.exchange is not None)})
    _agree(guards, what, signature)
    if strategy == "ulysses":
        head_state = state  # the 1-D group exchanges heads; nothing moves after
    route = Route(state, head_state, strategy, exchange, heads, plan, kernel, signature, args.softcap_or_none, size)
    routes[key] = route
    if len(routes) > _MAX_ROUTES:
        routes.popitem(last=False)
    return route


def _agree(states: list[GroupState], what: str, signature: dict) -> None:
    """Agreement on each group in turn; a failure on one is posted to the groups not reached yet,
    so that their ranks raise too instead of waiting."""
    for i, s in enumerate(states):
        try:
            s.guard.agree(what, signature)
        except DtcpError as e:
            for later in states[i + 1:]:
                later.guard.agree(what, signature, status=f"{type(e).__name__}: {e}")
            raise


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


def _signature(q, k, v, args: CallArgs, cu_values, state: GroupState, head_state: Optional[GroupState],
               sinks_shape) -> dict[str, str]:
    """What must be equal on every rank, as strings (the agreement's fields)."""
    return {
        "world size": str(state.size), "head group size": "-" if head_state is None else str(head_state.size),
        "q.shape": str(tuple(q.shape)), "k.shape": str(tuple(k.shape)), "v.shape": str(tuple(v.shape)),
        "dtype": str(q.dtype), "device type": q.device.type, "layout": args.layout,
        "is_causal": str(args.is_causal), "scale": repr(args.scale), "window_size": str(args.window),
        "cu_seqlens": digest(cu_values), "strategy": args.strategy, "backend": args.backend,
        "softcap": repr(args.softcap), "sinks": str(sinks_shape), "chunk_size": str(args.chunk_size),
        # how the ring's blocks travel (exec/grouped.py): a setting, but ranks that differ on it
        # would wait for transfers that never come
        "dtcp.config.ring_steps_per_launch": str(config.ring_steps_per_launch),
    }


@dataclass(frozen=True)
class _Problem:
    """One call as the builder sees it: the whole CP group (N = U * R ranks) and the mask."""

    layout: Layout
    row_segments: tuple
    world_size: int  # N
    cp_rank: int  # ring rank * U + ulysses rank on a 2-D mesh
    head_group_size: int  # U of a 2-D mesh, else 0
    # the ring's steps per launch as this build chose them ({(plans' ids, kernel): (plans, the
    # choice)}): "auto" predicts them for its strategy choice and the ring's route takes them,
    # computed once per build (a new document structure is a new build every batch)
    ring_choices: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_documents(self) -> bool:
        """Some row has a document (or chunk) mask: the all-gather can then be one varlen launch."""
        return any(seg is not None for seg in self.row_segments)


def _problem(q, args: CallArgs, cu_values, state, head_state) -> _Problem:
    """`state`, `head_state`: anything with .size and .rank (GroupStates; explain() passes plain
    numbers)."""
    u = head_state.size if head_state is not None else 0
    n = state.size * (u or 1)
    cp_rank = state.rank * u + head_state.rank if head_state is not None else state.rank
    local_len, batch = q.shape[2], q.shape[0]
    seq_len = local_len * n
    if args.layout == "doczigzag":  # the layout's documents travel as cu_seqlens (see DocZigzag)
        layout: Layout = DocZigzag.from_cu_seqlens(cu_values)
        layout.check(seq_len, n)
        row_segments = (layout.segments(n),) * batch
    elif balanced_options(args.layout) is not None:  # Balanced: the documents are the mask and decide the placement
        if cu_values is None:
            raise ValueError("layout 'balanced' needs the documents: pass layout=dtcp.Balanced(doc_lens) "
                             "(or Balanced.from_cu_seqlens(cu_seqlens)), or layout='balanced' with cu_seqlens")
        if batch > 1 and cu_values[-1] == batch * seq_len:
            raise ValueError("layout 'balanced' places one document structure, shared by every batch row; these "
                             f"cu_seqlens give each of the {batch} rows its own documents. Pack the batch into one row "
                             "(B=1), or use layout='zigzag' with these cu_seqlens")
        layout = Balanced.from_cu_seqlens(cu_values, **balanced_options(args.layout))
        layout.check(seq_len, n)
        row_segments = (segments_from_cu_seqlens(cu_values, seq_len),) * batch
    else:
        layout = layout_from_spec(args.layout)
        layout.check(seq_len, n)
        if cu_values is None:
            row_segments = (None,) * batch
        else:
            row_segments = tuple(segments_from_cu_seqlens(c, seq_len) for c in row_cu_seqlens(cu_values, batch, seq_len))
    if args.chunk_size:
        # Chunks refine the documents only now, after the layout is derived: DocZigzag places
        # whole documents (from cu_seqlens), and chunks must not move them.
        row_segments = tuple(chunk_segments(seg, seq_len, args.chunk_size) for seg in row_segments)
    return _Problem(layout, row_segments, n, cp_rank, u)


def _build(q, k, v, args: CallArgs, cu_values, state: GroupState, head_state: Optional[GroupState], sinks: bool):
    """(strategy, exchange, head plan, this rank's plan, kernel, ring steps per launch): local and
    deterministic, so every rank that agrees on the signature builds the same (kernel choice looks
    at every rank's tasks, and so does the choice of steps per launch)."""
    problem = _problem(q, args, cu_values, state, head_state)
    candidates = strategy_candidates(args.strategy, q, k, v, args, problem)
    error = None
    for strategy in candidates:
        try:
            if strategy == "ring":
                plans, kernel = _plans_and_kernel(strategy, problem.layout, q, k, v, args, problem.row_segments,
                                                  problem.world_size, sinks)
                size = ring_steps(plans, kernel, q, k, v, problem.world_size, problem.ring_choices)
                return strategy, strategy, None, plans[problem.cp_rank], kernel, size
            if strategy == "allgather":
                plan, kernel = _plan_and_kernel(strategy, problem.layout, q, k, v, args, problem.row_segments,
                                                problem.world_size, problem.cp_rank, sinks)
                return strategy, strategy, None, plan, kernel, 1
            # (the ring across hybrid groups takes the setting as it is; "auto" runs it step by step)
            size = config.ring_steps_per_launch if config.ring_steps_per_launch != "auto" else 1
            return (strategy,) + _heads_route(strategy, q, k, v, args, problem, sinks) + (size,)
        except ValueError as e:  # e.g. the named kernel cannot serve this schedule: try the next
            error = e
    raise error


def _heads_route(strategy: str, q, k, v, args: CallArgs, problem: _Problem, sinks: bool,
                 target: Optional[Target] = None):
    """(exchange, head plan, plan, kernel) of "ulysses" (U = N, local attention after the head
    exchange) or "hybrid" (U = the mesh's Ulysses dim, then the ring or all-gather over R groups).
    `target`: an assumed device to choose the kernel for (predictions on meta tensors)."""
    n, local_len, batch = problem.world_size, q.shape[2], q.shape[0]
    u = n if strategy == "ulysses" else problem.head_group_size
    r = n // u
    heads = ulysses_plan(problem.layout, local_len, u, r, problem.cp_rank, q.shape[1], k.shape[1],
                         f"strategy={strategy!r}")
    inner = inner_layout(problem.layout, u, r)

    def like(x, per_rank):  # stands for the exchanged tensor where only shape, dtype and device matter
        return x.new_empty(()).expand(batch, per_rank, u * local_len, x.shape[3])

    q_h, k_h, v_h = like(q, heads.q.per_rank), like(k, heads.kv.per_rank), like(v, heads.kv.per_rank)
    if r == 1:
        exchanges = ("allgather", "ring")  # one rank: nothing moves; the all-gather plan takes varlen in one call
    else:
        gathered_kv_bytes = (k_h.numel() * k.element_size() + v_h.numel() * v.element_size()) * r
        exchanges = exchange_candidates("auto", inner, u * local_len, r, q.device.type if target is None
                                        else target.device_type, gathered_kv_bytes, config.allgather_max_bytes,
                                        problem.has_documents)
    error = None
    for exchange in exchanges:
        try:
            plan, kernel = _plan_and_kernel(exchange, inner, q_h, k_h, v_h, args, problem.row_segments, r,
                                            problem.cp_rank // u, sinks, target)
            return exchange, heads, plan, kernel
        except ValueError as e:
            error = e
    raise error


def strategy_candidates(requested: str, q, k, v, args: CallArgs, problem: _Problem) -> tuple[str, ...]:
    """The strategies to try, best first. An explicit request is the only candidate. "auto": on a
    2-D mesh "hybrid"; on a 1-D group on CUDA `auto_order`; elsewhere the exchange policy of
    dtcp/plan/exchange.py (the ring on CPU, where strategies were not measured)."""
    if requested == "hybrid" or (requested == "auto" and problem.head_group_size):
        return ("hybrid",)
    if requested != "auto":
        return (requested,)
    if q.device.type != "cuda" or problem.world_size == 1:
        gathered_kv_bytes = (k.numel() * k.element_size() + v.numel() * v.element_size()) * problem.world_size
        return exchange_candidates("auto", problem.layout, q.shape[2], problem.world_size, q.device.type,
                                   gathered_kv_bytes, config.allgather_max_bytes, problem.has_documents)
    return auto_order(q, k, v, args, problem)[0]


def auto_order(q, k, v, args: CallArgs, problem: _Problem, backward: bool = True):
    """(strategies best first, the cost model's predictions) of strategy="auto" on CUDA. Where the
    whole sequence's K/V is at most dtcp.config.allgather_max_bytes and the layout allows it, the
    all-gather comes first whatever the model says: measured ahead there on H200s (host-bound
    calls; under torch.compile it is traced into the graph as one launch); the model orders the rest."""
    preds = predictions(q, k, v, args, problem, backward=backward)
    order = [p.strategy for p in preds]
    gathered_kv_bytes = (k.numel() * k.element_size() + v.numel() * v.element_size()) * problem.world_size
    if "allgather" in order and gathered_kv_bytes <= config.allgather_max_bytes:
        order.remove("allgather")
        order.insert(0, "allgather")
    return tuple(order), preds


@dataclass(frozen=True)
class _Size:
    size: int
    rank: int


def explain(q, k, v, args: CallArgs, cu_values, world_size: int, rank: int, head_group_size: int = 0,
            head_rank: int = 0, backward: bool = True) -> tuple[str, list[Prediction]]:
    """(what strategy="auto" picks, the cost model's predictions fastest first) for this call on
    CUDA; no communication (see dtcp.explain)."""
    head = _Size(head_group_size, head_rank) if head_group_size else None
    ring = _Size(world_size // head_group_size if head_group_size else world_size,
                 rank // head_group_size if head_group_size else rank)
    problem = _problem(q, args, cu_values, ring, head)
    if problem.head_group_size:
        return "hybrid", []
    order, preds = auto_order(q, k, v, args, problem, backward=backward)
    return order[0], preds


def predicted_target(q, machine) -> Optional[Target]:
    """The device kernels are chosen for in a prediction: q's own, except for meta tensors
    (dtcp.explain without a GPU), which stand for the GPU the cost model's machine describes
    (`Machine.compute_capability`, FlashAttention-4 counted as installed): the kernels a call on
    CUDA would run, so their rates and launches are that GPU's, not the math kernel's."""
    return Target("cuda", machine.compute_capability) if q.device.type == "meta" else None


def predictions(q, k, v, args: CallArgs, problem: _Problem, backward: bool = True) -> list[Prediction]:
    """The cost model's predictions for the strategies this call allows, fastest first. Each
    strategy's schedule is built as `_build` would (no communication) to count, on the slowest
    rank, its visible pairs and kernel launches, and to know which kernel serves it (kernels
    differ in speed, and not every kernel serves every schedule). Meta tensors are predicted for
    the machine's GPU (predicted_target)."""
    shape, allowed = call_shape(q, k, v, args, problem, backward)
    return rank_strategies(allowed, shape, machine_for(config.cost_machine))


def call_shape(q, k, v, args: CallArgs, problem: _Problem, backward: bool = True) -> tuple[CallShape, list[str]]:
    """(what the cost model needs of this call, the strategies it allows): pure arithmetic over
    the plans every rank would build, no communication. Per strategy, the kernel that serves it and
    the slowest rank's work: ring and all-gather count each rank's visible pairs and launches
    (`_launches`: one per varlen launch or task, as the executors run them) and take the largest;
    Ulysses' kernels see the whole sequence for Hq / N heads on every rank (balanced by
    construction)."""
    n, local_len = problem.world_size, q.shape[2]
    target = predicted_target(q, machine_for(config.cost_machine))
    kernels, launches = {}, {}
    ring_fields: dict = {}
    allgather_rows = None  # (the whole all-gather)
    for strategy in ("ring", "allgather", "ulysses"):
        try:
            if strategy == "ulysses":
                head_splits(q.shape[1], k.shape[1], n, "ulysses")
                _, _, plan, kernel = _heads_route("ulysses", q, k, v, args, problem, False, target)
                plans = [plan]  # every rank's inner plan does the same work
            else:
                if strategy == "allgather" and allgather_reason(problem.layout, local_len, n,
                                                                 problem.has_documents) is not None:
                    continue
                plans, kernel = _plans_and_kernel(strategy, problem.layout, q, k, v, args, problem.row_segments,
                                                  n, False, target)
        except ValueError:
            continue
        kernels[strategy] = kernel.name
        if strategy == "ring":  # (its launches as the executors run them, at the size they take)
            ring_fields = _ring_choice(plans, kernel, q, k, v, n, problem.ring_choices)[1]
            continue
        launches[strategy] = max(_launches(plan, kernel)[0] for plan in plans)
        if strategy == "allgather" and all(isinstance(p, VarlenPlan) and p.exchange is not None for p in plans):
            allgather_rows = max(max(p.exchange.fetched_rows, p.exchange.served_rows) for p in plans)
    allowed = list(kernels)
    masks = {seg: AttnMask.make(args.is_causal, args.window, seg) for seg in dict.fromkeys(problem.row_segments)}
    rows = list(problem.row_segments)
    batch = len(rows)

    def per_row(build) -> tuple[float, float]:
        """(slowest rank's pairs per row, all ranks' pairs per row) of one schedule, averaged
        over the batch rows."""
        per_rank = [0] * n
        for seg in rows:
            for rr, plan in enumerate(build(problem.layout, local_len, n, args.is_causal, masks[seg])):
                per_rank[rr] += plan_pairs(plan.tasks)
        return max(per_rank) / batch, sum(per_rank) / batch

    ring_pairs, total_pairs = per_row(ring_plans)
    rounds = ring_plans(problem.layout, local_len, n, args.is_causal, masks[rows[0]])[0].num_rounds
    if "ring_kv_len" not in ring_fields:  # (the ring's fields give it where the ring is a candidate)
        ring_fields = dict(ring_fields, ring_kv_len=_keys_per_round(ring_plans, problem.layout, local_len, n,
                                                                    args.is_causal, [masks[seg] for seg in rows]))
    ag_pairs = per_row(allgather_plans)[0] if "allgather" in allowed else ring_pairs
    shape = CallShape(batch=batch, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
                      v_head_dim=v.shape[3], elem_bytes=q.element_size(), world_size=n, local_len=local_len,
                      backward=backward, ring_pairs=ring_pairs, ring_rounds=rounds, **ring_fields,
                      allgather_pairs=ag_pairs, allgather_calls=launches.get("allgather", 1),
                      allgather_rows=allgather_rows, total_pairs=total_pairs,
                      ulysses_calls=launches.get("ulysses", 1), kernels=tuple(kernels.items()),
                      **_objective_fields())
    return shape, allowed


def _objective_fields() -> dict:
    """The CallShape fields of the objective in force (dtcp.config.cost_objective): "device" ranks
    the device's time alone, "step" weighs the host's time against the rest of the layer
    (dtcp.config.layer_flops_per_token), "call" counts both."""
    objective = config.cost_objective_in_force()
    return dict(host_hidden=objective == "device",
                other_flops_per_token=config.layer_flops_per_token if objective == "step" else None)


def _keys_per_round(build, layout, local_len: int, n: int, is_causal: bool, row_masks) -> float:
    """Keys a ring round moves, averaged over rounds and batch rows: in each round the ranks move
    in lockstep, so the widest span any rank receives sets it."""
    widths = []
    for mask in row_masks:
        plans = build(layout, local_len, n, is_causal, mask)
        widths += [max(p.steps[t].span_len for p in plans) for t in range(1, plans[0].num_rounds + 1)]
    return sum(widths) / len(widths) if widths else float(local_len)


def _plan_tasks(plan) -> list:
    """Every task of one rank's plan (a tuple: one plan per batch row)."""
    if isinstance(plan, tuple):
        return [t for p in plan for t in _plan_tasks(p)]
    return list(plan.tasks)


def _launches(plan, kernel: Kernel, size: int = 1) -> tuple[int, int]:
    """(kernel launches of one pass, forward or backward, query rows they cover) of one rank's
    plan as the executors run it: a varlen plan is one launch where the kernel makes it one; a
    ring plan is its fused steps' launches where the kernel has a one-launch varlen form and
    dtcp.config.ring_one_launch is on (plan/fuse.py fused_launches, as exec/fused.py decides),
    else one launch per task."""
    if isinstance(plan, tuple):
        parts = [_launches(p, kernel, size) for p in plan]
        return sum(c for c, _ in parts), sum(r for _, r in parts)
    if isinstance(plan, VarlenPlan):
        rows = sum(q_len for q_len, _ in plan.seq_lens)
        return (1 if kernel.varlen_one_launch else len(plan.seq_lens)), rows
    if isinstance(plan, RingPlan) and grouped(plan, kernel, size):  # the received blocks in groups (exec/grouped.py)
        groups = group_launches(plan, size, kernel.reject_varlen_reason, config.ring_groups_in_place)
        if groups is not None:  # (as exec/grouped.py decides: else step by step)
            local = plan_launches(plan)[0]
            launches = list(local) + [launch for g in groups for launch in g.launches]
            return len(launches), sum(launch.cu_q[-1] for launch in launches)
    if isinstance(plan, RingPlan) and fuses(kernel):
        fused = fused_launches(plan, kernel.reject_varlen_reason)
        if fused is not None:
            return sum(map(len, fused)), sum(launch.cu_q[-1] for step in fused for launch in step)
    return len(plan.tasks), sum(t.q_len for t in plan.tasks)


def _row_plans(plan, batch: int) -> list:
    """One rank's plan per batch row (a plan shared by every row stands for each)."""
    return list(plan) if isinstance(plan, tuple) else [plan] * batch


def _ring_traffic(plan: RingPlan, kernel: Kernel, size: int, local_len: int, kv_elems: int,
                  elem_bytes: int) -> tuple[float, float]:
    """(accumulator bytes per query-row element (plan/fuse.py accumulator_traffic), bytes the
    groups copy) of one pass of one batch row's ring plan, as the executors run it with `size`
    steps per launch: a group's keys and values packed into one buffer, forward and backward (none
    for a group read in place; `kv_elems`: K/V heads x (D + Dv) per key). (0, 0) where the steps
    run task by task."""
    if not fuses(kernel):
        return 0.0, 0.0
    fused = fused_launches(plan, kernel.reject_varlen_reason)
    if fused is None:
        return 0.0, 0.0
    gaps = takes_gaps(kernel)
    groups = group_launches(plan, size, kernel.reject_varlen_reason, config.ring_groups_in_place) \
        if grouped(plan, kernel, size) else None
    if groups is None:
        return accumulator_traffic(fused, local_len, gaps), 0.0
    steps = (fused[0],) + tuple(g.launches for g in groups if g.launches)
    packed = sum(g.packed_len for g in groups)  # (in place: none)
    return accumulator_traffic(steps, local_len, gaps), 2 * 2 * packed * kv_elems * elem_bytes


def _ring_launch_fields(plans, kernel: Kernel, size: int, q, k, v) -> dict:
    """CallShape's ring_calls (the rank that launches most), ring_q_block (query rows per launch
    of the rank with the most pairs), ring_acc_bytes and ring_copy_bytes (the rank that moves
    most, per batch row), ring_kv_len (keys a round moves) and ring_dkv_bytes of every rank's
    plans run at `size` steps per launch."""
    batch, local_len = q.shape[0], q.shape[2]
    work = [_launches(plan, kernel, size) for plan in plans]
    per_rank = [_row_plans(plan, batch) for plan in plans]
    # keys a round moves (the widest any rank receives, averaged over rounds and rows): in groups
    # each block comes from its home rank with only the keys its receiver uses (Step.direct_span)
    direct = grouped(per_rank[0][0], kernel, size)
    widths = [max((rows[b].steps[t].direct_len if direct else rows[b].steps[t].span_len) for rows in per_rank)
              for b in range(batch) for t in range(1, per_rank[0][b].num_rounds + 1)]
    pairs = [plan_pairs(_plan_tasks(plan)) for plan in plans]
    top = max(range(len(plans)), key=lambda r: pairs[r])
    kv_elems = k.shape[1] * (k.shape[3] + v.shape[3])
    traffic = [[_ring_traffic(p, kernel, size, local_len, kv_elems, q.element_size()) for p in _row_plans(plan, batch)]
               for plan in plans]
    # dK/dV going home: float32, or the kernel's gradient dtype where every chain is one hop of
    # one share per key (Step.one_share; step by step only)
    one_share = not direct and all(rows[b].steps[t].one_share for rows in per_rank for b in range(batch)
                                   for t in rows[b].chain_ends)
    dkv_bytes = min(4, kernel.grad_dtype(q.dtype).itemsize) if one_share else 4
    return dict(ring_steps_per_launch=size, ring_calls=max(count for count, _ in work),
                ring_kv_len=sum(widths) / len(widths) if widths else float(local_len),
                ring_dkv_bytes=dkv_bytes,
                ring_q_block=max(1, int(work[top][1] / max(1, work[top][0]))),
                ring_acc_bytes=max(sum(a for a, _ in t) for t in traffic) / batch,
                ring_copy_bytes=max(sum(c for _, c in t) for t in traffic) / batch)


#: "auto" groups the ring's received blocks only where the cost model predicts the pass this much
#: faster than step by step: on one H100 (bench_split, FA4, long-tailed mixes and causal 32K at
#: N = 4-16) the points it predicted within a few percent measured within +-5% either way, and
#: on 4 H100s with the real transfers (point-to-point from the home rank where the ring uses the
#: copy engines) groups of 3 ran from 11% faster to 6% slower than the ring at N = 4 (two runs,
#: benchmarks/results/strategies_4xh100_2026-11-27*_G*.json).
GROUP_GAIN = 0.10


def ring_steps(plans, kernel: Kernel, q, k, v, n: int, memo: Optional[dict] = None) -> int:
    """The ring's received blocks per launch for this call (exec/grouped.py): the setting
    dtcp.config.ring_steps_per_launch, or for "auto" the size of 4 or all the plan's rounds (one
    group) that the cost model predicts fastest for the rank that takes longest, where it beats
    step by step by GROUP_GAIN, else 1. `plans`: every rank's (each a RingPlan, or one per batch row).
    Deterministic over the plans, which every rank builds alike: every rank gets the same size.
    `memo`: one build's (_Problem.ring_choices), where the cost model may have chosen it already."""
    setting = config.ring_steps_per_launch
    return setting if setting != "auto" else _ring_choice(plans, kernel, q, k, v, n, memo)[0]


def _ring_choice(plans, kernel: Kernel, q, k, v, n: int, memo: Optional[dict] = None) -> tuple[int, dict]:
    """(ring_steps, its `_ring_launch_fields`): the fields the choice was predicted with, for the
    cost model's CallShape. `memo`: a dict that lives for one route build (the same q, k, v and
    settings), so the cost model's choice and the route's are one computation; keyed by the plans'
    identity and the kernel."""
    if memo is None:
        return _ring_choice_of(plans, kernel, q, k, v, n)
    key = (tuple(map(id, plans)), kernel.name)
    hit = memo.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], plans)):
        hit = memo[key] = (tuple(plans), _ring_choice_of(plans, kernel, q, k, v, n))
    return hit[1]


def _ring_choice_of(plans, kernel: Kernel, q, k, v, n: int) -> tuple[int, dict]:
    setting = config.ring_steps_per_launch
    if setting != "auto":
        return setting, _ring_launch_fields(plans, kernel, setting, q, k, v)
    batch, local_len = q.shape[0], q.shape[2]
    per_rank = [_row_plans(p, batch) for p in plans]
    row_rounds = [plan.num_rounds for plan in per_rank[0]]  # (every rank's plan of a row has as many)
    rounds = max(row_rounds)
    if rounds < 2 or not fuses(kernel):
        return 1, _ring_launch_fields(plans, kernel, 1, q, k, v)
    machine = machine_for(config.cost_machine)
    pairs = max(sum(plan_pairs(p.tasks) for p in rows) for rows in per_rank) / batch
    base = CallShape(batch=batch, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
                     v_head_dim=v.shape[3], elem_bytes=q.element_size(), world_size=n, local_len=local_len,
                     ring_pairs=pairs, ring_rounds=rounds, kernels=(("ring", kernel.name),),
                     **_objective_fields())  # (each size's fields add its launches, copies and keys a round)
    fields = {size: _ring_launch_fields(plans, kernel, size, q, k, v) for size in sorted({1, min(4, rounds), rounds})}
    predicted = {size: predict("ring", replace(base, **f), machine).total_s for size, f in fields.items()}
    best = min(sorted(predicted), key=lambda size: predicted[size])  # (ties: the smaller size)
    size = best if predicted[best] <= (1 - GROUP_GAIN) * predicted[1] else 1
    return size, fields[size]


def _plan_and_kernel(exchange, layout, q, k, v, args: CallArgs, row_segments, n: int, r: int, sinks: bool,
                     target: Optional[Target] = None):
    """(rank r's plan, kernel) for one exchange, or ValueError (see _plans_and_kernel)."""
    plans, kernel = _plans_and_kernel(exchange, layout, q, k, v, args, row_segments, n, sinks, target)
    return plans[r], kernel


def _plans_and_kernel(exchange, layout, q, k, v, args: CallArgs, row_segments, n: int, sinks: bool,
                      target: Optional[Target] = None):
    """(every rank's plan, kernel) for one exchange, or ValueError. The ring adds attention sinks
    itself, once per row after merging, so any kernel serves it; under the all-gather schedule each
    row is one kernel call and the kernel adds them. `target`: choose the kernel for an assumed
    device (predictions on meta tensors)."""
    local_len = q.shape[2]
    features = dict(v=v, softcap=args.softcap_or_none, sinks=sinks and exchange == "allgather", target=target)
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
        rank_rows = [tuple(row_plans[seg][rr] for seg in row_segments) for rr in range(n)]
        rank_plans = (varlen_plans(rank_rows, window) if config.allgather_exchange
                      else [VarlenPlan(rows, window) for rows in rank_rows])
        if all(p.rows_tiled for p in rank_plans) and varlen_reason(all_tasks, window) is None:
            seq_lens = [sl for p in rank_plans for sl in p.seq_lens]
            try:
                kernel = select_kernel(args.backend, q, k, all_tasks, varlen=(seq_lens, window), **features)
            except ValueError:
                kernel = None
            if kernel is not None and (per_row or kernel.varlen_one_launch):
                return rank_plans, kernel
    if exchange == "allgather":
        # Not one varlen launch: one kernel call per run, which takes only layouts of few equal runs.
        why = allgather_reason(layout, local_len, n)
        if why is not None:
            raise ValueError(f"strategy='allgather': {why}. Use strategy='ring' (or 'auto')")
    kernel = select_kernel(args.backend, q, k, all_tasks, **features)
    if per_row:
        return [tuple(row_plans[seg][rr] for seg in row_segments) for rr in range(n)], kernel
    return list(row_plans[distinct[0]]), kernel


# ---- running -------------------------------------------------------------------------------------
def run_forward(route: Route, q, k, v, scale: float, keep_gathered_kv: bool = False,
                sinks: Optional[torch.Tensor] = None):
    """(out, lse, kept): `kept` is, with `keep_gathered_kv`, what the backward can reuse instead of
    communicating again (the all-gather schedule's gathered K/V; for a head exchange, the
    exchanged tensors: `HeadResiduals`), else None. With `sinks` (Hq,), lse includes them."""
    with on_device_of(q), _failures(route, "forward"):
        sink = None if sinks is None else sinks.detach().to(acc_dtype(q.dtype))
        if route.heads is not None:
            result = _heads_forward(route, q, k, v, scale, keep_gathered_kv, sink)
        else:
            comm = route.ring_comm(q, k, v, backward=False) if _has_ring(route.plan) else None
            result = _forward(route, route.plan, q, k, v, scale, keep_gathered_kv, comm, sink)
        _end_of_call(route, q)
        return result


def run_backward(route: Route, dout, q, k, v, out, lse, scale: float, gathered_kv=None,
                 sinks: Optional[torch.Tensor] = None):
    """(dq, dk, dv, dsinks) given the forward's final out and lse; `gathered_kv`: what run_forward
    kept, or None to communicate again (then q, k, v, out and lse must be given). dsinks (this
    rank's share, like every parameter's gradient under context parallelism) is None without sinks."""
    with on_device_of(dout), _failures(route, "backward"):
        if route.heads is not None:
            dq, dk, dv, dsinks = _heads_backward(route, dout, q, k, v, out, lse, scale, gathered_kv, sinks)
        else:
            comm = route.ring_comm(q, k, v, backward=True) if _has_ring(route.plan) else None
            dq, dk, dv = _backward(route, route.plan, dout, q, k, v, out, lse, scale, gathered_kv, comm)
            dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        _end_of_call(route, dout)
        return dq, dk, dv, dsinks


@dataclass
class HeadResiduals:
    """What a head-exchange forward keeps for its backward: this rank's heads over the group's
    tokens (q_h (B, h, U*L, D), k_h/v_h (B, hkv, U*L, D/Dv), out_h, lse_h (B, h, U*L)) and the
    inner schedule's own kept tensors. The same memory as the sequence shards they replace."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    inner: object


def _sink_heads(route: Route, sink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if sink is None:
        return None
    first = route.heads.q.first_head(route.heads.rank)
    return sink[first:first + route.heads.q.per_rank]


def _heads_forward(route: Route, q, k, v, scale, keep: bool, sink):
    heads, pg = route.heads, route.head_comm_group()
    q_h, k_h, v_h = to_heads([(q, heads.q), (k, heads.kv), (v, heads.kv)], heads, pg)
    comm = route.ring_comm(q_h, k_h, v_h, backward=False) if _has_ring(route.plan) else None
    # (Ulysses: the inner "gather" over one rank is a local copy, not worth keeping twice)
    keep_inner = keep and route.seq_state is not None
    out_h, lse_h, inner_kept = _forward(route, route.plan, q_h, k_h, v_h, scale, keep_inner, comm,
                                        _sink_heads(route, sink))
    out, lse = to_sequence([(out_h, heads.q, out_h.dtype), (lse_h.unsqueeze(-1), heads.q, lse_h.dtype)], heads, pg)
    kept = HeadResiduals(q_h, k_h, v_h, out_h, lse_h, inner_kept) if keep else None
    return out, lse.squeeze(-1), kept


def _heads_backward(route: Route, dout, q, k, v, out, lse, scale, kept: Optional[HeadResiduals], sinks):
    heads, pg = route.heads, route.head_comm_group()
    if kept is None:  # the custom op's backward: exchange the forward's tensors again, with dout
        q_h, k_h, v_h, out_h, lse_h, dout_h = to_heads(
            [(q, heads.q), (k, heads.kv), (v, heads.kv), (out, heads.q), (lse.unsqueeze(-1), heads.q),
             (dout, heads.q)], heads, pg)
        lse_h, inner_kept = lse_h.squeeze(-1), None
    else:
        (dout_h,) = to_heads([(dout, heads.q)], heads, pg)
        q_h, k_h, v_h, out_h, lse_h, inner_kept = kept.q, kept.k, kept.v, kept.out, kept.lse, kept.inner
    comm = route.ring_comm(q_h, k_h, v_h, backward=True) if _has_ring(route.plan) else None
    # Replicated K/V heads (Hkv < U) come back from several ranks and are summed: in float32 for
    # half inputs, as dK/dV are everywhere else. Each replica's dK/dV is then handed over as the
    # inner schedule summed it, in float32, not rounded to the inputs' dtype first (one rounding
    # in all, as a ring or Ulysses alone gives).
    acc = acc_dtype(k_h.dtype)
    wider = heads.kv.replicas > 1 and acc.itemsize > k_h.dtype.itemsize
    dq_h, dk_h, dv_h = _backward(route, route.plan, dout_h, q_h, k_h, v_h, out_h, lse_h, scale, inner_kept, comm,
                                 kv_dtype=acc if wider else None)
    dq, dk, dv = to_sequence([(dq_h, heads.q, q_h.dtype), (dk_h, heads.kv, k_h.dtype), (dv_h, heads.kv, v_h.dtype)],
                             heads, pg, sum_dtype=acc)
    dsinks = None
    if sinks is not None:  # this rank's heads over the group's tokens: its share of those heads' gradient
        first, h = heads.q.first_head(heads.rank), heads.q.per_rank
        dsinks = torch.zeros_like(sinks)
        dsinks[first:first + h] = sink_grad(dout_h, out_h, lse_h, sinks[first:first + h])
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
    if q.device.type == "cuda":
        for state in route.states:
            if state.size > 1:
                state.assert_healthy(q.device)


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
        if grouped(plan, route.kernel, route.steps_per_launch):
            return grouped_forward(q, k, v, plan, route.kernel, scale, comm or _LOCAL, **options,
                                   size=route.steps_per_launch) + (None,)
        return ring_forward(q, k, v, plan, route.kernel, scale, comm or _LOCAL, **options) + (None,)
    # one plan per batch row (rows with their own documents, no varlen kernel): a call per row,
    # the same calls in the same order on every rank
    rows = [_forward(route, p, q[b:b + 1], k[b:b + 1], v[b:b + 1], scale, keep_gathered_kv, comm, sink)
            for b, p in enumerate(plan)]
    return (torch.cat([o for o, _, _ in rows]), torch.cat([lse for _, lse, _ in rows]),
            [kv for _, _, kv in rows] if keep_gathered_kv else None)


def _backward(route, plan, dout, q, k, v, out, lse, scale, gathered_kv, comm, kv_dtype=None):
    """dq, dk, dv of the route's inner schedule; dk and dv in `kv_dtype` where given (float32 sums
    that the head exchange adds up again: `_heads_backward`), else in k's and v's dtypes."""
    if isinstance(plan, VarlenPlan):
        return varlen_backward(dout, q, k, v, out, lse, route.comm_group(), plan, route.kernel, scale, kv=gathered_kv,
                               softcap=route.softcap, kv_dtype=kv_dtype)
    if isinstance(plan, AllGatherPlan):
        return allgather_backward(dout, q, k, v, out, lse, route.comm_group(), plan, route.kernel, scale,
                                  kv=gathered_kv, softcap=route.softcap, kv_dtype=kv_dtype)
    if isinstance(plan, RingPlan):
        if grouped(plan, route.kernel, route.steps_per_launch):
            return grouped_backward(dout, q, k, v, out, lse, plan, route.kernel, scale, comm or _LOCAL,
                                    softcap=route.softcap, kv_dtype=kv_dtype, size=route.steps_per_launch)
        return ring_backward(dout, q, k, v, out, lse, plan, route.kernel, scale, comm or _LOCAL, softcap=route.softcap,
                             kv_dtype=kv_dtype)
    grads = [
        _backward(route, p, *(t[b:b + 1] for t in (dout, q, k, v, out, lse)), scale,
                  None if gathered_kv is None else gathered_kv[b], comm, kv_dtype)
        for b, p in enumerate(plan)
    ]
    return tuple(torch.cat(g) for g in zip(*grads))


class _LocalOnly:
    """The 'exchange' of a plan with no rounds (one rank, or every needed block local)."""

    @staticmethod
    def spare_buffers(like, kind, dtype=None):  # pragma: no cover - a plan without rounds asks for none
        raise AssertionError("a ring plan without rounds exchanges nothing")

    @staticmethod
    def finish() -> None:
        pass

    drain = finish


_LOCAL = _LocalOnly()


@contextlib.contextmanager
def _failures(route: Route, what: str):
    """Turn any failure inside a call into an error on every rank (see the module docstring)."""
    guards = [s.guard for s in route.states]
    try:
        yield
    except DtcpError:
        raise
    except Exception as e:
        own = f"rank {route.rank}: {what} failed: {type(e).__name__}: {e}"
        peer = next((p for p in (g.peer_failure() for g in guards) if p is not None), None)
        for guard in guards:
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
