"""The functions: `dtcp.ring_attention` (a drop-in for F.scaled_dot_product_attention on
context-parallel shards) and `dtcp.flash_attn_varlen_func` (flash-attn's varlen interface).

Each checks its arguments, then makes one call into dtcp.ops. An argument error raises here, naming
the parameter and the fix, and is also posted to the group's other ranks (dtcp/comm/guard.py), so
that a rank whose peer made a bad call raises too instead of waiting for it.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _compat, ops
import dataclasses
import warnings

from ._groups import GroupLike, cp_size_and_rank_of, group_rank, group_size, resolve_cp_groups
from .comm import state_of
from .exec.route import CallArgs
from .config import config
from .exec.calibrate import calibrate as _calibrate
from .exec.calibrate import slowest, timed
from .exec.route import explain as _explain
from .frontends.window import current_window
from .kernels import default_scale
from .layouts import (
    Auto, Balanced, DEFAULT_LAYOUT, Contiguous, DocZigzag, Layout, SlidingWindow, Zigzag, check_window, layout_from_spec,
)
from .plan import check_kv_exchange, check_strategy
from .plan import cost as _cost
from .plan.cost import machine_for


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike = None,
    *,
    layout: Union[Layout, str] = DEFAULT_LAYOUT,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    backend: str = "auto",
    return_lse: bool = False,
    window_size: Optional[tuple[int, int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    strategy: str = "auto",
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    kv_exchange: Optional[str] = None,
    chunk_size: Optional[int] = None,
):
    """Exact attention over a sequence sharded across a context-parallel group.

    Each rank passes its own shard, in `layout` order. The result equals full single-device
    attention over the whole sequence, restricted to this rank's tokens:
    ``layout.unshard(out) == F.scaled_dot_product_attention(full_q, full_k, full_v, ...)``,
    and so do the gradients of q, k and v. Every rank of the group must make the same call (same
    shapes, layout, mask, scale, ...); if they differ, or one rank fails, every rank raises.

    Args:
        q: (B, Hq, S_local, D) this rank's queries.
        k: (B, Hkv, S_local, D) this rank's keys; Hkv divides Hq (GQA needs ``enable_gqa=True``,
            as in SDPA). K/V travel with Hkv heads.
        v: (B, Hkv, S_local, Dv) this rank's values; Dv may differ from D (MLA-style models), as in
            SDPA (the math kernel, and kernels that declare it, take it).
        group: the context-parallel group: a ProcessGroup, a 1-D DeviceMesh, or None (default
            group); for strategy="hybrid" a 2-D DeviceMesh (ring dim, Ulysses dim) or a pair
            (ring_group, ulysses_group), CP rank = ring rank * U + Ulysses rank.
        layout: how the sequence is split (dtcp.Contiguous(), dtcp.Zigzag(), dtcp.Striped(block),
            dtcp.DocZigzag(doc_lens), dtcp.Balanced(doc_lens): packed documents with equal tokens
            and equal causal work per rank; it carries its documents, which are then the mask).
            "balanced" (``dtcp.Balanced()``, no documents) with `cu_seqlens`: the placement of
            ``dtcp.Balanced.from_cu_seqlens(cu_seqlens)``, the boundaries passed as a tensor.
        is_causal: causal attention over global token positions.
        scale: softmax scale; default 1/sqrt(D).
        backend: "auto" (fastest kernel that serves the request), "math", "cpu_flash", "flash",
            "cudnn", "fa2" (flash-attn package), "flex" (flex_attention); see docs/guide/backends.md.
        return_lse: also return the log-sum-exp.
        window_size: (left, right) sliding window in flash-attn's convention (query i sees keys
            i - left .. i + right; -1 = unbounded; causal needs right = 0). Default: the window of
            an enclosing ``dtcp.attention_window``, else of a ``dtcp.SlidingWindow`` layout, else none.
            With the contiguous layout the ring runs only the rounds the window needs.
        cu_seqlens: (num_docs + 1,) int tensor of global document boundaries of the packed
            sequence (0 = c0 <= ... <= cn = S, the same on every rank): tokens attend only within
            their document, the same documents in every batch row. For rows with their own
            documents (B > 1): the boundaries over the batch flattened row-major, 0 ... B*S, with
            a boundary at every row start b*S (torchtitan's and flash-attn's packed batches).
            Rows that see no key at all get out 0 and lse 0. The values are read once per call (a
            CUDA tensor costs a device synchronisation; CPU boundaries cost none).
        strategy: how the work is spread over the group (docs/guide/strategies.md). "ring": K/V
            blocks travel around the ring, each transfer overlapped with the previous block's
            kernels (dK/dV travel back the same way); a window on the contiguous layout needs only
            the rounds it reaches. "allgather": one all-gather of K/V, one reduce-scatter of dK/dV
            (contiguous and zigzag layouts). "ulysses": an all-to-all trades tokens for heads
            ((B, H, S/N, D) -> (B, H/N, S, D)), attention runs over the whole sequence, a second
            all-to-all brings the output back; Hq must be a multiple of N, and Hkv a multiple or a
            divisor of N (K/V heads are then replicated, their gradients summed). "hybrid": on a
            2-D mesh, Ulysses inside each group of the Ulysses dim and the ring (or all-gather)
            across them. "auto" (default): on CUDA the cost model's fastest (``dtcp.explain``
            shows its predictions); on a 2-D mesh "hybrid"; on CPU the ring. All give the same
            result, to rounding.
        kv_exchange: deprecated alias of ``strategy`` ("auto", "ring", "allgather").
        softcap: tanh capping of the scaled scores, ``softcap * tanh(score / softcap)``, before the
            mask (Gemma 2's attention logit soft-capping); None (or 0) for none. Needs a kernel
            that takes it (math, fa2, flex; ``backend="auto"`` finds one).
        sinks: (Hq,) learnable attention-sink logits (gpt-oss's ``sinks``/``s_aux``): each joins
            every row's softmax denominator once, with no value, unscaled and unmasked. Applied
            once per row after merging the ring's blocks; gradients flow to it (each rank's rows'
            share, like any parameter's under context parallelism: sum it over the group, e.g.
            with FSDP over the cp ranks). Rows that see no key at all stay out 0, lse 0.
        chunk_size: chunked attention (Llama 4's ``attention_chunk_size``): tokens attend only
            within consecutive chunks of `chunk_size` tokens, counted from the start of the
            sequence, or of each document with `cu_seqlens` (a document sees the chunks it would
            see alone). Intersected with the causal mask, the window and the documents. None: none.

    Returns:
        out (B, Hq, S_local, Dv), and with ``return_lse=True`` also lse (B, Hq, S_local), natural
        log, float32 (float64 for float64 inputs), including the sinks. lse is returned detached:
        it carries no gradient.
    """
    layout = layout_from_spec(layout)
    pg, head_pg = resolve_cp_groups(group)
    n, cp_rank = cp_size_and_rank_of(pg, head_pg)
    if kv_exchange is not None and not torch.compiler.is_compiling():  # (dynamo cannot trace warnings.warn)
        warnings.warn("ring_attention(kv_exchange=...) is deprecated: use strategy=... (the same values, and "
                      "'ulysses' and 'hybrid')", DeprecationWarning, stacklevel=2)
    try:
        strategy = _strategy_from_alias(strategy, kv_exchange)
        check_strategy(strategy, head_pg is not None)
        _check_inputs(q, k, v, enable_gqa, scale)
        softcap = _check_softcap(softcap)
        _check_sinks(sinks, q)
        if scale is None:
            scale = default_scale(q.shape[-1])
        left, right = resolve_window(window_size, layout, is_causal)
        _check_cu_seqlens(cu_seqlens)
        chunk = _check_chunk_size(chunk_size)
        if isinstance(layout, Auto):
            raise ValueError("layout='auto' is chosen per batch by context_parallel and the integrations, which "
                             "shard the batch; ring_attention takes the resolved layout: "
                             "dtcp.Auto().resolve(cu_seqlens, seq_len), or layout='balanced' with cu_seqlens")
        if isinstance(layout, Balanced) and not layout.carries_documents:
            # the documents of `cu_seqlens` decide the placement, as Balanced.from_cu_seqlens would;
            # the boundaries stay a tensor (no guard on their values under torch.compile)
            if cu_seqlens is None:
                raise ValueError("layout='balanced' (dtcp.Balanced()) places the documents of cu_seqlens: pass "
                                 "cu_seqlens (the packed sequence's boundaries, the same ones the inputs were sharded "
                                 "with), or layout=dtcp.Balanced(doc_lens)")
            layout_spec = layout.op_spec()
        elif isinstance(layout, DocZigzag):
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: a DocZigzag layout carries its documents (and their padding); "
                                 "pass cu_seqlens=None")
            # Only the layout's boundaries tensor reaches the op (and torch.compile's graph): a new
            # document structure every batch is a new input, not a new graph. The op checks the
            # padded length against the values.
            layout_spec, cu_seqlens = "doczigzag", layout.cu_seqlens
        elif isinstance(layout, Balanced):
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: a Balanced layout carries its documents (they are the mask and decide "
                                 "the placement); pass cu_seqlens=None")
            # As for DocZigzag: only the boundaries tensor reaches the op and the compiled graph. The
            # length check reads the documents, so under torch.compile it would guard on them (a
            # recompile per batch); there the op checks the same values at run time instead.
            if not torch.compiler.is_compiling():
                layout.check(q.shape[2] * n, n)
            layout_spec, cu_seqlens = layout.op_spec(), layout.cu_seqlens
        else:
            layout.check(q.shape[2] * n, n)
            layout_spec = layout.spec()
    except (ValueError, TypeError) as e:
        for g in (pg, head_pg):
            if g is not None:
                _tell_peers(g, group_size(g), e)
        raise
    args = CallArgs(_compat.name_of_group(pg), layout_spec, bool(is_causal), float(scale), backend, left, right,
                    strategy, softcap, "" if head_pg is None else _compat.name_of_group(head_pg), chunk)
    out, lse = ops.attention(q, k, v, args, cu_seqlens, cp_rank, n, sinks)
    return (out, lse.detach()) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    max_seqlen: Optional[int] = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    group: GroupLike = None,
    layout: Union[Layout, str] = Contiguous(),
    backend: str = "auto",
    return_lse: bool = False,
    strategy: str = "auto",
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    kv_exchange: Optional[str] = None,
):
    """flash-attn's `flash_attn_varlen_func` for a packed sequence sharded over a CP group.

    Args:
        q: (T_local, Hq, D) this rank's packed tokens.
        k: (T_local, Hkv, D), Hkv dividing Hq.
        v: (T_local, Hkv, D).
        cu_seqlens: (num_docs + 1,) int32 global document boundaries of the whole packed
            sequence (one tensor for q and k: this is self-attention); None with a DocZigzag
            layout, which carries its documents.
        max_seqlen: accepted for flash-attn compatibility and not needed (the planner reads
            the boundaries themselves).
        causal: causal attention, as in flash-attn.
        window_size: (left, right), -1 unbounded, as in flash-attn.
        softmax_scale: as in flash-attn; default 1/sqrt(D).
        group: as in `ring_attention`.
        layout: as in `ring_attention`; the default is contiguous, where a window needs the fewest rounds.
        backend: as in `ring_attention`.
        return_lse: also return the log-sum-exp.
        strategy: as in `ring_attention`.
        softcap: as in flash-attn (0: none) and `ring_attention`.
        sinks: (Hq,) attention-sink logits, as in `ring_attention`.
        kv_exchange: deprecated alias of ``strategy``.

    Returns:
        out (T_local, Hq, D); with return_lse=True also lse (Hq, T_local), as flash-attn.
    """
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"flash_attn_varlen_func: {name} must be a (total_tokens, heads, head_dim) tensor; got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if max_seqlen is not None and (not isinstance(max_seqlen, int) or max_seqlen < 1):
            raise TypeError(f"max_seqlen must be a positive int or None; got {max_seqlen!r}")
        if kv_exchange is not None:
            if not torch.compiler.is_compiling():
                warnings.warn("flash_attn_varlen_func(kv_exchange=...) is deprecated: use strategy=...",
                              DeprecationWarning, stacklevel=2)
            strategy, kv_exchange = _strategy_from_alias(strategy, kv_exchange), None
    except (ValueError, TypeError) as e:
        for g in resolve_cp_groups(group):
            if g is not None:
                _tell_peers(g, group_size(g), e)
        raise
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, lse = ring_attention(
        q4, k4, v4, group, layout=layout, is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1],
        backend=backend, return_lse=True, window_size=window_size, cu_seqlens=cu_seqlens, strategy=strategy,
        softcap=softcap or None, sinks=sinks, kv_exchange=kv_exchange,
    )
    out = out[0].transpose(0, 1)
    return (out, lse[0]) if return_lse else out


def hidden_ring_steps(local_len: int, world_size: int, batch: int = 1) -> int:
    """How many ring steps of a rank the rest of a training step's layer hides on the host, under
    the cost objective in force (`dtcp.config.cost_objective`, `layer_flops_per_token`,
    `cost_machine`): what `Balanced(hidden_steps=)` wants for a batch of `batch` rows of
    `local_len` tokens per rank over `world_size` ranks. "call": 0 (every step's host time
    counts); "device": `world_size` (the device's time alone); "step": the steps whose host time
    (an FA4 launch pair and the step's bookkeeping, about 1.2 ms) the layer's other device work
    covers. `context_parallel(layout="auto")` and the integrations resolve each batch with it."""
    return _cost.hidden_ring_steps(config.cost_objective_in_force(), config.layer_flops_per_token, batch, local_len,
                                   world_size, machine_for(config.cost_machine))


def resolve_auto(layout: Auto, cu_seqlens, seq_len: Optional[int], world_size: int, batch: int = 1,
                 strategy: str = "auto") -> Layout:
    """layout="auto" for one batch of `batch` rows of `seq_len` tokens over `world_size` ranks:
    `Auto.resolve` with the ring steps the cost objective in force hides (`hidden_ring_steps`;
    none without documents, or for a length the ranks do not share evenly, which the sharding
    refuses anyway). With `dtcp.config.auto_placement = "fastest"` and `attention_heads` set, a
    Balanced batch is placed for the strategy predicted fastest on it
    (`placed_for_the_fastest_strategy`; `strategy`: the calls' own, "auto" or one strategy).
    Where `context_parallel` and the integrations resolve each batch."""
    even = bool(seq_len) and seq_len % world_size == 0
    hidden = hidden_ring_steps(seq_len // world_size, world_size, batch) if cu_seqlens is not None and even else 0
    resolved = layout.resolve(cu_seqlens, seq_len, hidden_steps=hidden)
    if isinstance(resolved, Balanced) and config.auto_placement == "fastest" and even and world_size > 1:
        if config.attention_heads is None:
            raise ValueError("dtcp.config.auto_placement='fastest' places each batch for the calls the cost model "
                             "predicts on it: set dtcp.config.attention_heads = (query heads, key/value heads, head "
                             "dim) of the model's attention (the Trainer, transformers and torchtitan integrations "
                             "set it from the model), or use auto_placement='ring'")
        return placed_for_the_fastest_strategy(resolved, world_size, batch, strategy)
    return resolved


#: the work-balanced placement's shortest cut chunk (Balanced(min_chunk=)): two FlashAttention-4
#: query tiles. With no ring steps to save, a cut costs its pieces a partly masked tile and the
#: keys the all-gather's exchange then moves; by the cost model (32/8 heads of 128, bench_split's
#: log-normal mixes over 16 ranks) 256 beats 128 by 10% there, at 1.02x the mean's work or less.
WORK_MIN_CHUNK = 256
#: a ring placement whose busiest rank holds more than this fraction above the mean's work is
#: weighed against the work-balanced one (below it, balancing the work cannot pay)
WORK_IMBALANCE = 0.05
#: ... which is taken where the cost model predicts it at least this much faster (the model's
#: error on measured calls: median 10%)
WORK_GAIN = 0.10


def placed_for_the_fastest_strategy(ring_placed: Balanced, world_size: int, batch: int = 1,
                                    strategy: str = "auto") -> Balanced:
    """`ring_placed` (Balanced's placement for the ring: its ring steps weighed against the work
    it leaves a rank, `Balanced(hidden_steps=)`), or the placement that balances the work alone
    (`Balanced(min_chunk=WORK_MIN_CHUNK, hidden_steps=world_size)`) where the strategy the cost
    model picks on it (`strategy="auto"`, or `strategy` itself) is predicted `WORK_GAIN` faster
    than its pick on `ring_placed`, for calls of `dtcp.config.attention_heads` over these
    documents (causal, bf16; `explain`'s predictions, which see what the call would run on CUDA).

    Why: the ring's placement keeps a rank up to 2.3x the mean's work to spare it ring steps
    (log-normal mixes of 128K tokens over 16 ranks), which the all-gather's one launch and
    Ulysses' whole-sequence kernels do not take; the all-gather over documents moves only the
    keys other ranks read, few on a placement that cuts few documents. Deterministic: every rank
    places alike (the op agrees on the placement's spec, and raises on every rank otherwise)."""
    work = ring_placed.rank_work(world_size)
    mean = sum(work) / world_size
    if not mean or max(work) <= (1 + WORK_IMBALANCE) * mean:
        return ring_placed
    work_placed = work_balanced(ring_placed, world_size)
    if max(work_placed.rank_work(world_size)) >= max(work):  # (the same placement, or no better balanced)
        return ring_placed
    ring_s = _predicted_call_s(ring_placed, world_size, batch, strategy)
    work_s = _predicted_call_s(work_placed, world_size, batch, strategy)
    return work_placed if work_s < (1 - WORK_GAIN) * ring_s else ring_placed


def work_balanced(ring_placed: Balanced, world_size: int) -> Balanced:
    """The placement of `ring_placed`'s documents that balances the work alone (every ring step
    hidden, chunks down to WORK_MIN_CHUNK): what placed_for_the_fastest_strategy weighs."""
    return Balanced(ring_placed.doc_lens, min_chunk=min(ring_placed.min_chunk, WORK_MIN_CHUNK),
                    hidden_steps=world_size)


def _predicted_call_s(placed: Balanced, world_size: int, batch: int, strategy: str) -> float:
    """The cost model's time for a causal call of dtcp.config.attention_heads (bf16) over
    `placed`'s documents with `strategy` ("auto": what auto would pick), or inf where it allows
    none."""
    q_heads, kv_heads, head_dim = config.attention_heads
    local_len = sum(placed.doc_lens) // world_size
    q = torch.empty(batch, q_heads, local_len, head_dim, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(batch, kv_heads, local_len, head_dim, device="meta", dtype=torch.bfloat16)
    args = CallArgs("", placed.op_spec(), True, default_scale(head_dim), "auto", -1, -1, strategy)
    try:
        pick, preds = _explain(q, kv, kv, args, tuple(placed.cu_seqlens.tolist()), world_size, 0)
    except ValueError:
        return float("inf")
    want = pick if strategy == "auto" else strategy
    return next((p.total_s for p in preds if p.strategy == want), float("inf"))


def op_layout(layout: Layout, cu_seqlens=None) -> tuple[str, Optional[tuple[int, ...]]]:
    """(the layout's spec as the op receives it, the document boundaries as numbers or None): a
    Balanced layout's documents (or, for Balanced(), the call's `cu_seqlens`), a DocZigzag's own
    boundaries, else the call's. What `explain` predicts with, and tests/sim_ranks.py builds
    simulated ranks' routes with."""
    if isinstance(layout, Balanced):  # its documents, or (Balanced()) the call's
        cu = layout.cu_seqlens if layout.carries_documents else cu_seqlens
        return layout.op_spec(), None if cu is None else tuple(torch.as_tensor(cu).tolist())
    if isinstance(layout, DocZigzag):
        return layout.name, tuple(layout.cu_seqlens.tolist())
    return layout.spec(), None if cu_seqlens is None else tuple(torch.as_tensor(cu_seqlens).tolist())


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike = None,
    *,
    layout: Union[Layout, str] = DEFAULT_LAYOUT,
    is_causal: bool = False,
    window_size: Optional[tuple[int, int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    backward: bool = True,
) -> str:
    """What ``strategy="auto"`` picks for this call on CUDA, and why: the cost model's predicted
    time of every strategy the call allows (dtcp/plan/cost.py), fastest first, with the kernel
    each runs on and its launches per pass on the rank that launches most. Takes the shards a
    ``ring_attention`` call would get (q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D/Dv); only
    their shapes, dtype and device matter) and the same mask arguments; makes no communication.
    Meta tensors stand for the GPU the cost model's machine describes: kernels are chosen as on
    CUDA with its compute capability (``Machine.compute_capability``), FlashAttention-4 counted
    as installed. The constants are dtcp.config.cost_machine (dtcp.calibrate() measures them),
    else the shipped H200 NVLink figures; the times are an isolated call's, with
    dtcp.config.cost_objective = "device" the device's alone, or with "step" (or "auto" and
    dtcp.config.layer_flops_per_token set) the call's share of a training step (the report says
    which). On CPU,
    "auto" takes the ring whatever the model says.

    Returns a multi-line report; its first line is ``auto -> <strategy>``."""
    layout = layout_from_spec(layout)
    ring_pg, head_pg = resolve_cp_groups(group)
    n, cp_rank = cp_size_and_rank_of(ring_pg, head_pg)
    u = group_size(head_pg) if head_pg is not None else 0
    left, right = resolve_window(window_size, layout, is_causal)
    layout_spec, cu_values = op_layout(layout, cu_seqlens)
    args = CallArgs("", layout_spec, bool(is_causal), default_scale(q.shape[-1]), "auto", left, right, "auto")
    choice, preds = _explain(q, k, v, args, cu_values, n, cp_rank, u, cp_rank % u if u else 0, backward=backward)
    why = "" if not preds or preds[0].strategy == choice else \
        " [short: the all-gather first, K/V <= dtcp.config.allgather_max_bytes]"
    lines = [f"auto -> {choice}{why}  ({'forward + backward' if backward else 'forward'}, {n} ranks, "
             f"q {tuple(q.shape)}, k {tuple(k.shape)}, {layout!r}, causal={is_causal}, window=({left}, {right}))"]
    for p in preds:
        lines.append(f"  {p.strategy:<10} predicted {p.total_s * 1e3:9.3f} ms  (kernels {p.kernel_s * 1e3:.3f} ms "
                     f"on {p.kernel} x {p.launches} launches, communication {p.comm_s * 1e3:.3f} ms of which "
                     f"exposed {p.exposed_comm_s * 1e3:.3f} ms{'; ' + p.note if p.note else ''})")
    objective = config.cost_objective_in_force()
    if preds and objective == "device":
        lines.append("  (dtcp.config.cost_objective='device': the device's time alone, no host time counted)")
    elif preds and objective == "step":
        lines.append(f"  (cost objective 'step': each time is the call's share of a training step, the larger of its "
                     f"device time and the host time the rest of its layer does not cover, at "
                     f"dtcp.config.layer_flops_per_token = {config.layer_flops_per_token:.4g})")
    if not preds:
        lines.append("  a 2-D mesh runs 'hybrid' (Ulysses over its inner dim, ring or all-gather across)")
    elif q.device.type == "meta":
        cc = machine_for(config.cost_machine).compute_capability
        lines.append(f"  (meta tensors: kernels as on a CUDA GPU of compute capability {cc[0]}.{cc[1]}, "
                     "FlashAttention-4 counted as installed)")
    return "\n".join(lines)


def calibrate(group: GroupLike = None, *, device: Optional[torch.device] = None, apply: bool = True,
              dtype: torch.dtype = torch.bfloat16, **options):
    """Measure the cost model's constants on this machine (a few seconds; collective: every rank of
    `group` calls it) and, with `apply`, make them dtcp.config.cost_machine, which
    ``strategy="auto"`` and ``dtcp.explain`` use from then on. Measured: a ring transfer, a matmul, an
    all-to-all, a tiny all-to-all (latency), a device copy, every available kernel's rate on a long
    square causal block, the auto kernel at two block lengths, and each strategy's fixed host cost
    per call (a small call of each, less what the model predicts for it). The slowest rank's
    figures are kept, so every rank decides alike. Returns the `dtcp.plan.Machine`. `options`:
    heads, head_dim, seq_len, transfer_bytes, repeats (dtcp/exec/calibrate.py). Calls after it
    build their routes anew (routes are keyed by the constants); a function compiled before keeps
    what it traced: calibrate before compiling."""
    pg = resolve_cp_groups(group)[0]
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    machine = _calibrate(pg, device, dtype=dtype, **options)
    n = group_size(pg)
    if n > 1:
        machine = dataclasses.replace(machine, fixed_s=_fixed_costs(pg, n, device, dtype, machine))
    if apply:
        config.cost_machine = machine
    return machine


def _fixed_costs(pg, n: int, device: torch.device, dtype: torch.dtype, machine) -> tuple:
    """(strategy, seconds) each strategy's small call takes beyond the model's prediction for it:
    its host cost (Python, launches, synchronisation) that no byte or flop count shows."""
    local, heads, head_dim = 512, 8, 64
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, local, head_dim, device=device, dtype=dtype, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    layout = Zigzag()
    args = CallArgs("", layout.spec(), True, default_scale(head_dim), "auto", -1, -1, "auto")
    with config.override(cost_machine=machine):
        _, preds = _explain(q, k, v, args, None, n, group_rank(pg), backward=True)
    predicted = {p.strategy: p.total_s for p in preds}
    measured = []
    for strategy in predicted:
        def step():
            out = ring_attention(q, k, v, pg, layout=layout, is_causal=True, strategy=strategy)
            out.backward(dout)

        measured.append(max(0.0, timed(step, device, 5, group=pg) - predicted[strategy]))
    return tuple(zip(predicted, slowest(measured, pg, device)))


def _strategy_from_alias(strategy: str, kv_exchange: Optional[str]) -> str:
    if kv_exchange is None:
        return strategy
    check_kv_exchange(kv_exchange)
    if strategy != "auto" and strategy != kv_exchange:
        raise ValueError(f"strategy={strategy!r} and kv_exchange={kv_exchange!r} disagree: pass strategy only "
                         "(kv_exchange is its deprecated alias)")
    return kv_exchange


def resolve_window(window_size, layout: Layout, is_causal: bool) -> tuple[int, int]:
    """The (left, right) window in force: explicit argument, then dtcp.attention_window, then
    a SlidingWindow layout's; (-1, -1) when none."""
    if window_size is not None:
        window = check_window(window_size, "window_size")
    elif current_window() is not None:
        window = current_window()
    elif isinstance(layout, SlidingWindow):
        window = layout.window
    else:
        window = (-1, -1)
    if is_causal and window[1] > 0:
        raise ValueError(
            f"window_size={window} looks ahead {window[1]} tokens, but is_causal=True allows none: "
            f"use window_size=({window[0]}, 0) for a causal sliding window, or is_causal=False"
        )
    return window


def _tell_peers(pg, world_size: int, error: Exception) -> None:
    """Post this rank's argument error to the group's other ranks (they raise PeerFailedError where
    they wait for this call) — not while tracing a graph, whose errors end the compile."""
    if world_size > 1 and not torch.compiler.is_compiling():
        state_of(pg).guard.agree("dtcp.ring_attention", {}, status=f"{type(error).__name__}: {error}")


def _check_softcap(softcap) -> float:
    """The softcap as the op takes it: a positive float, or 0.0 for none."""
    if softcap is None or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap == 0):
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap must be a positive number (scores become softcap * tanh(score / softcap)) or None; "
                         f"got {softcap!r}")
    return float(softcap)


def _check_sinks(sinks, q) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1:
        raise TypeError(f"sinks must be a 1-D floating-point tensor of one logit per query head; got "
                        f"{type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else (tuple(sinks.shape), sinks.dtype)}")
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must have one logit per query head: q has {q.shape[1]} heads, sinks has {sinks.shape[0]}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}); got {sinks.device}")


def _check_chunk_size(chunk_size) -> int:
    """0 for none; else the chunk length, a positive int."""
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk) or None; got {chunk_size!r}")
    return int(chunk_size)


def _check_cu_seqlens(cu_seqlens) -> None:
    # Shape and dtype only: the values are checked inside the op, which reads them anyway
    # (reading them here would break torch.compile graphs).
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a 1-D int32 tensor of global document boundaries (0, ..., S, or 0, ..., B*S "
            f"for rows with their own documents); got "
            f"{type(cu_seqlens).__name__}. Wrap it: torch.tensor(boundaries, dtype=torch.int32)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must be a 1-D int32 (or int64) tensor; got shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}"
        )


def _check_inputs(q, k, v, enable_gqa, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, S_local, D) as in SDPA; got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}. Cast them first.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim (which may differ, as in SDPA); "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch size differs: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k/v must hold the same local tokens: q has S_local={q.shape[2]}, k/v have {k.shape[2]}. "
            "dtcp shards self-attention; every rank passes q, k, v of its own tokens."
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dim differs: q has {q.shape[3]}, k/v have {k.shape[3]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the key/value heads ({hkv})")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"q has {hq} heads and k/v have {hkv}: pass enable_gqa=True for grouped-query attention")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None; got {type(scale).__name__}")
