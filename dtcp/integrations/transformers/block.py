"""The block (`context_parallel`): checks the model, prepares and shards the batch, agrees on it
across the cp ranks, and makes dtcp's attention function active for the forward and backward;
plus `sum_gradients`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ...comm import state_of
from ...config import config as dtcp_config
from ...frontends.context import ContextParallelHandle
from ...frontends.context import context_parallel as _sdpa_context_parallel
from ...frontends.context import resolve_cp_mesh
from ...layouts import Auto, Balanced, Layout, layout_from_spec
from ...plan import decoder_layer_flops_per_token
from ..._groups import cp_size_and_rank
from . import _state
from .attention_function import ATTN_IMPLEMENTATION
from .batch import prepare_batch

_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_LOCAL_MAX_ROPE = ("dynamic", "longrope")


# ---- checks on the model ----------------------------------------------------------------------------


def _configs(config) -> list:
    out, todo = [], [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is o for o in out):
            continue
        out.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            todo.append(getattr(c, key, None))
    return out


def _rope_types(params) -> list[str]:
    if isinstance(params, Mapping):
        found = [params["rope_type"]] if isinstance(params.get("rope_type"), str) else []
        for v in params.values():
            found += _rope_types(v)
        return found
    return []


def text_config(model: torch.nn.Module):
    """The model's (text) config: a multimodal config's text part, else the config itself (None
    without one)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_flops_per_token(model: torch.nn.Module) -> Optional[float]:
    """The FLOPs per token of one decoder layer's matmuls, forward + backward, from the model's
    (text) config: what dtcp's "step" cost objective weighs each attention call's host time
    against (dtcp.config.layer_flops_per_token). Mixture-of-experts configs count the experts a
    token is routed to (``num_experts_per_tok`` MLPs of ``moe_intermediate_size``, else of
    ``intermediate_size``) and shared experts (``shared_expert_intermediate_size``, or
    ``n_shared_experts`` x ``moe_intermediate_size``); MLPs are taken as gated (Llama's). None
    when the config lacks the sizes."""
    text = text_config(model)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    ffn = getattr(text, "intermediate_size", None)
    experts = getattr(text, "num_experts_per_tok", None)
    expert_ffn = getattr(text, "moe_intermediate_size", None) or ffn
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    if isinstance(experts, int) and experts > 0 and isinstance(expert_ffn, int):
        shared = getattr(text, "shared_expert_intermediate_size", None) or \
            (getattr(text, "n_shared_experts", None) or 0) * expert_ffn
        return decoder_layer_flops_per_token(hidden, expert_ffn, heads, kv_heads, head_dim,
                                             experts_per_token=experts, shared_ffn=int(shared))
    if not isinstance(ffn, int):
        return None
    return decoder_layer_flops_per_token(hidden, ffn, heads, kv_heads, head_dim)


def attention_heads(model: torch.nn.Module) -> Optional[tuple[int, int, int]]:
    """(query heads, key/value heads, head dim) of the model's attention, from its (text) config:
    what `layout="auto"` places a packed batch for (dtcp.config.attention_heads). None when the
    config lacks them."""
    text = text_config(model)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if not (isinstance(heads, int) and heads > 0):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(hidden, int) else None)
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and head_dim > 0 and heads % kv_heads == 0):
        return None
    return heads, kv_heads, head_dim


def check_model(model: torch.nn.Module) -> Optional[str]:
    """Why `model` cannot run under dtcp's context parallelism, or None. Depends on the model's
    configuration only, so it is the same on every rank."""
    config = getattr(model, "config", None)
    if config is None:
        return (f"context_parallel(model=...) expects a transformers PreTrainedModel (with .config); got "
                f"{type(model).__name__}. For other models use dtcp.context_parallel.")
    for c in _configs(config):
        impl = getattr(c, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            return (f"{type(c).__name__}._attn_implementation={impl!r}: under context parallelism only "
                    f"attn_implementation='{ATTN_IMPLEMENTATION}' sees every attention call (any other would attend "
                    f"to this rank's shard only). Build the model with attn_implementation='{ATTN_IMPLEMENTATION}' "
                    f"(from_pretrained/from_config) or call model.set_attn_implementation('{ATTN_IMPLEMENTATION}') "
                    "after importing dtcp.integrations.transformers.")
        types = getattr(c, "layer_types", None) or ()
        other = sorted({t for t in types if t not in _LAYER_TYPES})
        if other:
            return (f"{type(c).__name__}.layer_types contains {other}: layers that mix tokens without an attention "
                    "call (linear attention, state-space) cannot be split over the sequence by dtcp. Only models "
                    "whose layers are full_attention, sliding_attention or chunked_attention are supported.")
        chunk = getattr(c, "attention_chunk_size", None)
        if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
            return (f"{type(c).__name__}.layer_types has chunked_attention layers but attention_chunk_size={chunk!r}: "
                    "set attention_chunk_size to the chunk length (a positive int).")
        if "chunked_attention" in types:
            # dtcp's attention function reads the layer type from the attention module's config
            # and layer_idx (transformers hands it the chunking only as a mask): every chunked
            # layer needs an attention module (one with is_causal) that exposes them.
            seen = {m.layer_idx for m in model.modules()
                    if getattr(m, "config", None) is c and hasattr(m, "is_causal") and isinstance(getattr(m, "layer_idx", None), int)}
            missing = [i for i, t in enumerate(types) if t == "chunked_attention" and i not in seen]
            if missing:
                return (f"{type(c).__name__}.layer_types has chunked_attention layers {missing} whose attention module "
                        "does not expose .config and .layer_idx: dtcp's attention function could not tell that they "
                        "are chunked (it would attend across chunks). Give the attention modules these attributes.")
        if chunk and "chunked_attention" not in types:
            return (f"{type(c).__name__}.attention_chunk_size={chunk} without chunked_attention in layer_types: dtcp "
                    "cannot tell which layers are chunked. Set layer_types (or attention_chunk_size=None).")
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
        bad = sorted(set(_rope_types(rope)) & set(_LOCAL_MAX_ROPE))
        if bad:
            return (f"{type(c).__name__} uses rope_type {bad}, whose frequencies depend on the largest position in the "
                    "forward's position_ids: under context parallelism each rank sees only its shard's positions. "
                    "Use a rope_type that does not (default, linear, yarn, llama3) for CP training.")
        drop = getattr(c, "attention_dropout", 0.0)
        if model.training and isinstance(drop, (int, float)) and drop > 0:
            return (f"{type(c).__name__}.attention_dropout={drop} in training mode: dtcp's attention is exact and "
                    "has no dropout. Set config.attention_dropout = 0.0.")
    return None


def check_model_for_length(model: torch.nn.Module, seq_len: int) -> Optional[str]:
    """Why `model` cannot run a sequence of `seq_len` tokens under context parallelism, or None.

    Llama 4's NoPE layers with ``attn_temperature_tuning`` scale each query by
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, with p = ``arange`` over the tokens of
    the forward (models/llama4, Llama4TextAttention): the rank's shard, not the global positions.
    The scale is 1 for every p < floor_scale - 1, so sequences shorter than floor_scale are exact."""
    for c in _configs(getattr(model, "config", None)):
        if not getattr(c, "attn_temperature_tuning", False):
            continue
        nope = [i for i, rope in enumerate(getattr(c, "no_rope_layers", None) or ()) if not rope]
        floor_scale = getattr(c, "floor_scale", None)
        if nope and isinstance(floor_scale, (int, float)) and seq_len >= floor_scale:
            return (f"{type(c).__name__}.attn_temperature_tuning=True: its NoPE layers {nope} scale queries by their "
                    "position counted over the tokens of the forward (this rank's shard under context parallelism, "
                    f"not the global position), which changes the scale from floor_scale={floor_scale} tokens on; "
                    f"the sequence has {seq_len}. Use sequences shorter than {floor_scale} tokens, or set "
                    "config.attn_temperature_tuning = False (and check it against your checkpoint).")
    return None


# ---- the front ----------------------------------------------------------------------------------------


class HFContextParallel(ContextParallelHandle):
    """What `context_parallel` binds: dtcp's block handle (mesh, group, layout, world_size, rank,
    positions) plus the model's inputs for this rank."""

    def __init__(self, mesh, group, layout: Layout, inputs: dict):
        super().__init__(mesh, group, layout)
        self.inputs = inputs

    @property
    def num_items_in_batch(self):
        return self.inputs.get("num_items_in_batch")

    def gather(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full tensor (original token order) of a per-token result, e.g. logits (B, S/N, V) ->
        (B, S, V). Differentiable."""
        return self.layout.unshard(local, self.group, dim)

    def loss(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss (detached): the sum of the ranks' shares of HF's loss."""
        total = local_loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


def _checkpointing(model) -> bool:
    # transformers 5.23 renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def _grad_marker(model) -> tuple:
    for p in model.parameters():
        if p.requires_grad:
            return (id(p.grad), None if p.grad is None else p.grad._version)
    return ()


@contextlib.contextmanager
def context_parallel(
    model: torch.nn.Module,
    mesh,
    batch: Optional[Mapping[str, Any]] = None,
    *,
    mesh_dim: Union[str, int, None] = None,
    layout: Union[Layout, str] = "auto",
    backend: str = "auto",
    strategy: str = "auto",
    check_batch: bool = True,
) -> Iterator[HFContextParallel]:
    """Context parallelism for a transformers model with ``attn_implementation="dtcp"``.

    Args:
        model: the model (its configuration is checked; the model itself is not changed).
        mesh: a 1-D DeviceMesh over the cp ranks, or an N-D mesh with `mesh_dim`.
        batch: the *full* batch, the same on every cp rank: ``input_ids`` (B, S) (or
            ``inputs_embeds``), optional ``labels`` (B, S) (shifted here, on the whole sequence),
            ``shift_labels``, ``position_ids`` ((B, S) or (1, S); global ``arange(S)`` when absent;
            restarts are document boundaries, HF's packing rule), ``attention_mask`` (2-D padding:
            left/right padding becomes documents), ``cu_seq_lens_q`` (DataCollatorWithFlattening),
            ``num_items_in_batch`` (default: the batch's non-ignored targets) and any other model
            keyword. S must be a multiple of ``layout.multiple(N)`` (2N for "auto").
        mesh_dim: the cp dim's name when `mesh` is N-D.
        layout: "auto" (default): per batch, dtcp.Balanced for one packed row of documents
            (equal tokens and equal causal work per rank on any document mix), else dtcp.Zigzag()
            (balanced causal work); ``cp.layout`` says which. Or a fixed one: dtcp.Zigzag(),
            dtcp.Contiguous() (fewest rounds for sliding windows), dtcp.Striped(b).
        backend, strategy: as in dtcp.ring_attention.
        check_batch: agree on a digest of the batch across the cp ranks (one host round trip
            through the store): a batch that differs between cp ranks raises on every rank.

    Yields:
        `HFContextParallel`: ``inputs`` (pass ``model(**cp.inputs)``), ``group``, ``layout``,
        ``gather(local, dim)``, ``loss(local_loss)``.
    """
    if isinstance(mesh_dim, (tuple, list)):
        raise ValueError(f"mesh_dim={tuple(mesh_dim)!r}: dtcp.integrations.transformers takes one cp dim (a 1-D cp "
                         "group); 2-D CP meshes (strategy='hybrid') are not supported here yet. Pass one dim name.")
    _, pg = resolve_cp_mesh(mesh, mesh_dim)
    layout = layout_from_spec(layout)
    error = check_model(model)
    inputs, fields = {}, {}
    batch_layout = layout.resolve(None) if isinstance(layout, Auto) else layout  # (no batch: the user shards with cp.layout)
    layer_flops, heads = layer_flops_per_token(model), attention_heads(model)
    if error is None and batch is not None:
        try:
            # (under the model's layer work and heads: Auto's placement weighs the ring steps it
            # hides, and under auto_placement="fastest" places for the strategy predicted fastest)
            with dtcp_config.layer_work(layer_flops, heads):
                inputs, error, fields, batch_layout = prepare_batch(batch, pg, layout, model, strategy)
            if error is None:
                rows = inputs.get("input_ids", inputs.get("inputs_embeds"))
                error = check_model_for_length(model, int(rows.shape[1]) * cp_size_and_rank(pg)[0])
        except Exception as e:  # noqa: BLE001 - posted to the other ranks, then raised here
            error, exc = f"{type(e).__name__}: {e}", e
        else:
            exc = None
    else:
        exc = None
    n = cp_size_and_rank(pg)[0]
    if n > 1:
        if not check_batch:
            fields = {}
        if error is not None:
            state_of(pg).guard.agree("dtcp.integrations.transformers.context_parallel", fields, status=error)
        else:
            state_of(pg).guard.agree("dtcp.integrations.transformers.context_parallel", fields)
    if exc is not None:
        raise exc
    if error is not None:
        raise ValueError(error)
    if _state.ACTIVE is not None:
        raise RuntimeError("dtcp.integrations.transformers.context_parallel blocks do not nest")
    state = _state.state_for(pg, layout, backend, strategy)
    # The attention calls take a Balanced batch as a Balanced without documents plus the boundaries
    # tensor (the same placement): one object and a tensor under torch.compile, not a new object
    # per batch. (Auto resolves to one Zigzag object for every batch without documents.)
    configured = state.configured_layout
    if isinstance(configured, Auto):
        state.layout = configured.by_boundaries(batch_layout) if isinstance(batch_layout, Balanced) else batch_layout
    state.seen = False
    state.mask_windows = ()
    # The batch's boundaries and shard shape go to the attention function through the block's
    # state, so that they reach it even when the model does not forward **kwargs to its layers.
    # (not a model keyword: a wrapper may hand the model copies of its keywords, e.g. FSDP2 moving
    # them to the GPU, and a copy could not be told from boundaries of the user's own)
    state.cu_seqlens = inputs.pop("cu_seq_lens_q", None)
    rows = inputs.get("input_ids", inputs.get("inputs_embeds"))
    state.shard = (int(rows.shape[0]), int(rows.shape[1])) if batch is not None else None
    marker = _grad_marker(model)
    _state.ACTIVE = state
    clean = False
    try:
        # Direct F.scaled_dot_product_attention calls (outside transformers' interface) become exact
        # ring attention too, instead of attending to the local shard.
        # They get the batch's documents too.
        documents = {} if state.cu_seqlens is None else {"cu_seqlens": state.cu_seqlens}
        with _sdpa_context_parallel(mesh, mesh_dim=mesh_dim, layout=batch_layout, backend=backend, strategy=strategy,
                                    **documents), dtcp_config.layer_work(layer_flops, heads):
            # (the model's layer work, unless the user set it: the default cost objective, "auto",
            # then ranks each attention call as part of a training step)
            yield HFContextParallel(mesh, pg, batch_layout, inputs)
        clean = True
    finally:
        _state.ACTIVE = None
        state.cu_seqlens = state.shard = None
    if clean and not state.seen:
        raise RuntimeError(
            f"no attn_implementation='{ATTN_IMPLEMENTATION}' attention call ran inside "
            "dtcp.integrations.transformers.context_parallel: the model's attention does not go through "
            "transformers' attention interface (or the model was not called), so whatever it computed attended "
            "to this rank's shard only. Call model(**cp.inputs) inside the block, with a model whose attention "
            "layers use ALL_ATTENTION_FUNCTIONS (all of transformers' own decoder models do)."
        )
    if clean and _checkpointing(model) and model.training and torch.is_grad_enabled() and marker \
            and _grad_marker(model) == marker:
        raise RuntimeError(
            "gradient checkpointing is on and no gradient was accumulated inside the block: the backward recomputes "
            "attention, and outside the block that recomputation would attend to this rank's shard only. Call "
            "loss.backward() inside the context_parallel block."
        )


def sum_gradients(model: torch.nn.Module, group) -> None:
    """Sum every parameter's gradient over the cp group: each rank's gradient is its tokens' share
    (HF's loss on each rank is its share of the whole batch's loss), so the sum is the one-process
    gradient. Not needed when FSDP shards over the cp ranks with a sum (see the docs)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
