"""dtcp as the context parallelism of Hugging Face transformers causal LMs (transformers >=5.23,<5.24,
``pip install "dtcp[transformers]"``).

Importing this module registers an attention implementation and a mask function named ``"dtcp"``
with transformers::

    import dtcp.integrations.transformers as dtcp_hf           # registers attn_implementation="dtcp"

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dtcp")   # or from_pretrained(...)
    with dtcp_hf.context_parallel(model, mesh, batch, mesh_dim="cp") as cp:
        out = model(**cp.inputs)          # this rank's shard; HF's own loss, exact shares
        out.loss.backward()               # inside the block (gradient checkpointing recomputes here)
    dtcp_hf.sum_gradients(model, cp.group)  # or FSDP over (dp, cp): see docs/integrations/transformers.md

What each piece does:

* **the attention function** (``attn_implementation="dtcp"``). Inside a block it runs
  ``dtcp.ring_attention`` with what transformers passes each layer: ``scaling``, ``is_causal``,
  the layer's own ``sliding_window`` (HF's ``W`` keys, the query included, is dtcp's
  ``window_size=(W - 1, 0)``), ``softcap`` (Gemma 2), ``s_aux`` (gpt-oss sinks, with gradient)
  and ``cu_seq_lens_q`` (global document boundaries, which the block passes in). Outside a block
  it is HF's eager attention over HF's own masks (sdpa's boolean masks), so the same model object
  trains without CP, evaluates and generates unchanged.
* **the mask function**: outside a block HF's ``sdpa_mask``; inside one, no mask (dtcp builds
  the mask from the window and the documents), and a 2-D ``attention_mask`` that reaches the
  model raises (on every rank: its presence is the same on all of them), naming the fix (give it
  to the block, which turns padding into documents).
* **the block** (`context_parallel`): from the *full* batch (the same on every cp rank; checked)
  it makes global ``position_ids`` when absent, labels shifted before sharding (``shift_labels``)
  and a global ``num_items_in_batch`` (so HF's loss on each rank is its exact share: the shares
  sum to the one-process loss), global document boundaries from packing (``position_ids`` that
  restart, as ``DataCollatorWithFlattening`` makes, or its ``cu_seq_lens_q``) and from padding
  (a 2-D ``attention_mask``: each row's padding becomes documents of its own), then shards the
  sequence tensors in the block's layout. Any problem raises on every rank before the forward
  (dtcp's agreement: the rank with the problem raises it, the others raise ``PeerFailedError``
  naming it). It refuses attention it cannot see: a model (or sub-config) whose attention
  implementation is not ``"dtcp"``, layer types other than full and sliding attention (linear
  attention, Mamba, chunked attention mix tokens across shards), RoPE whose frequencies depend
  on the local maximum position (``dynamic``, ``longrope``), and a block in which the model's
  forward made no ``"dtcp"`` attention call at all. Direct ``F.scaled_dot_product_attention``
  calls inside the block run exact ring attention too (``dtcp.context_parallel``'s rewrite).

transformers internals this relies on are listed, with the versions checked, in ``_patches.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _patches

_patches.check_transformers_version()

from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from ...api import ring_attention  # noqa: E402
from ...comm import state_of  # noqa: E402
from ...comm.guard import digest  # noqa: E402
from ...frontends.context import ContextParallelHandle  # noqa: E402
from ...frontends.context import context_parallel as _sdpa_context_parallel  # noqa: E402
from ...frontends.context import resolve_cp_mesh  # noqa: E402
from ...layouts import DEFAULT_LAYOUT, DocZigzag, Layout, layout_from_spec  # noqa: E402
from ..._groups import cp_size_and_rank  # noqa: E402

__all__ = [
    "ATTN_IMPLEMENTATION",
    "attention",
    "mask",
    "context_parallel",
    "prepare_batch",
    "HFContextParallel",
    "sum_gradients",
    "SUPPORTED_TRANSFORMERS",
]

ATTN_IMPLEMENTATION = "dtcp"
SUPPORTED_TRANSFORMERS = _patches.SUPPORTED
IGNORE_INDEX = -100
_SEQ_KEYS = ("input_ids", "inputs_embeds", "position_ids", "shift_labels", "token_type_ids")
_DROPPED_KEYS = ("max_length_q", "max_length_k", "seq_idx", "cu_seq_lens_k")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_LOCAL_MAX_ROPE = ("dynamic", "longrope")


# ---- the block's state -----------------------------------------------------------------------------


class _Active:
    """What the attention function needs inside a block: the group, the layout, the options, and
    a write-only flag saying a "dtcp" attention call ran (write-only, so torch.compile replays it
    as a side effect without guarding on its value)."""

    def __init__(self, group, layout: Layout, backend: str, strategy: str):
        self.group, self.layout, self.backend, self.strategy = group, layout, backend, strategy
        self.seen = False


_ACTIVE: Optional[_Active] = None
# One state object per configuration, reused from step to step: dynamo guards on the object a
# compiled attention call reads, so a fresh one every step would recompile every step.
_STATES: dict = {}


def _state_for(group, layout: Layout, backend: str, strategy: str) -> _Active:
    key = (group, layout, backend, strategy)
    try:
        hash(key)
    except TypeError:
        return _Active(group, layout, backend, strategy)
    state = _STATES.get(key)
    if state is None:
        if len(_STATES) >= 16:
            _STATES.pop(next(iter(_STATES)))
        state = _STATES[key] = _Active(group, layout, backend, strategy)
    return state


# ---- the attention function -------------------------------------------------------------------------


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
              sliding_window: Optional[int] = None, softcap: Optional[float] = None,
              s_aux: Optional[torch.Tensor] = None, is_causal: Optional[bool] = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``attn_implementation="dtcp"``.

    query (B, Hq, S, D), key/value (B, Hkv, S, D) with RoPE applied; returns ((B, S, Hq, Dv), None).
    Inside `context_parallel` S is this rank's shard and the result is exact attention over the
    whole sequence; outside it is HF's eager attention (HF's own masks)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    state = _ACTIVE
    if state is None:
        out = _local_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                               softcap, s_aux, causal)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation='dtcp' inside dtcp.integrations.transformers.context_parallel got an attention_mask "
            f"({type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}); a mask over "
            "local shards cannot describe attention across ranks. Pass no attention_mask to the model: give the 2-D "
            "padding mask to the block (context_parallel(model, mesh, batch) with batch['attention_mask']), which "
            "turns padding into documents; 4-D custom masks are not supported under context parallelism."
        )
    if dropout:
        raise ValueError(
            f"attn_implementation='dtcp' under context parallelism got attention dropout={dropout}; dtcp's attention "
            "is exact and has no dropout. Set the model's attention_dropout to 0.0 (config.attention_dropout = 0.0)."
        )
    window = None
    if sliding_window is not None:
        if not causal:
            raise ValueError(
                f"sliding_window={sliding_window} with is_causal=False (bidirectional sliding attention) is not "
                "supported by attn_implementation='dtcp' under context parallelism; use a causal model."
            )
        # HF: key j is visible to query i when i - W < j <= i (W keys, the query's own included):
        # dtcp's window_size=(W - 1, 0).
        window = (int(sliding_window) - 1, 0)
    cu = kwargs.get("cu_seq_lens_q")
    out = ring_attention(
        query, key, value, state.group, layout=state.layout, is_causal=bool(causal), scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], backend=state.backend, window_size=window, cu_seqlens=cu,
        strategy=state.strategy, softcap=softcap or None, sinks=s_aux,
    )
    state.seen = True
    return out.transpose(1, 2).contiguous(), None


def _local_attention(module, q, k, v, mask, dropout, scaling, sliding_window, softcap, s_aux, causal):
    """HF's eager attention (models/gemma2, models/gpt_oss), over HF's boolean sdpa mask, or plain
    causal when the mask builder left it out. The mask already carries the window, padding and
    packing; `sliding_window` is HF's own business here (its mask builder read it)."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal and q.shape[2] > 1:
        s_q, s_k = q.shape[2], k.shape[2]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask[..., : k.shape[2]]
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).to(scores.dtype).expand(q.shape[0], -1, q.shape[2], 1)
        scores = torch.cat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=torch.float32 if scores.dtype in (torch.float16, torch.bfloat16)
                      else scores.dtype)
    if s_aux is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training).to(v.dtype)
    return torch.matmul(probs, v)


def mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
    """transformers' mask interface for ``"dtcp"``: HF's ``sdpa_mask`` outside a block; no mask
    inside one (a 2-D padding mask there raises: give it to the block)."""
    if _ACTIVE is None:
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None:
        raise ValueError(
            "attention_mask reached a model with attn_implementation='dtcp' inside "
            "dtcp.integrations.transformers.context_parallel: a padding mask over local shards cannot describe "
            "attention across ranks. Give the full 2-D attention_mask to the block instead "
            "(context_parallel(model, mesh, {'input_ids': ..., 'attention_mask': ...})), which turns padding into "
            "documents, and call model(**cp.inputs)."
        )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask)


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
                    "call (linear attention, state-space, chunked attention) cannot be split over the sequence by "
                    "dtcp. Only models whose layers are full_attention or sliding_attention are supported.")
        if getattr(c, "attention_chunk_size", None):
            return (f"{type(c).__name__}.attention_chunk_size={c.attention_chunk_size}: chunked attention is not "
                    "supported under context parallelism (set attention_chunk_size=None or run without CP).")
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


# ---- the batch -----------------------------------------------------------------------------------------


def _is_seq_tensor(value, batch: int, seq: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq and value.shape[0] in (1, batch)


def _boundaries_from_positions(position_ids: torch.Tensor) -> list[list[int]]:
    """HF's packing rule (masking_utils.find_packed_sequence_indices): a document starts wherever
    the position does not follow the previous one by exactly 1. Per row, starts > 0."""
    pos = position_ids.detach().to("cpu", torch.int64)
    breaks = torch.diff(pos, dim=-1) != 1
    return [(torch.nonzero(row).flatten() + 1).tolist() for row in breaks]


def _boundaries_from_padding(attention_mask: torch.Tensor) -> tuple[list[list[int]], Optional[str]]:
    """Each row of a 2-D padding mask as documents: one run of real tokens, padding before and/or
    after it (their own documents: nobody real sees them). Holes inside the real tokens cannot be
    documents: an error."""
    m = attention_mask.detach().to("cpu") != 0
    rows = []
    for b, row in enumerate(m):
        idx = torch.nonzero(row).flatten()
        if idx.numel() == 0:
            rows.append([])
            continue
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if idx.numel() != hi - lo:
            return [], (f"attention_mask row {b} has padding between real tokens (positions {lo}..{hi - 1} are not all "
                        "1): only left and/or right padding can be turned into documents. Pack the sequences instead "
                        "(DataCollatorWithFlattening) or pad at the ends.")
        rows.append([x for x in (lo, hi) if 0 < x < row.numel()])
    return rows, None


def _cu_seqlens(starts: list[list[int]], seq: int) -> Optional[torch.Tensor]:
    """Global boundaries over the batch flattened row-major (dtcp's cu_seqlens for B rows with their
    own documents), padded with repeated S*B to a power-of-two length so that torch.compile sees few
    shapes. None when no row has a document boundary."""
    if not any(starts):
        return None
    bounds = [0]
    for b, row in enumerate(starts):
        bounds += [b * seq + s for s in sorted(set(row))] + [(b + 1) * seq]
    size = 8
    while size < len(bounds):
        size *= 2
    bounds += [bounds[-1]] * (size - len(bounds))
    return torch.tensor(bounds, dtype=torch.int32)


def prepare_batch(batch: Mapping[str, Any], group, layout: Layout) -> tuple[dict, Optional[str], dict]:
    """The model's keyword arguments for this rank, from the full batch (see `context_parallel`).

    Returns (inputs, error, fields): `error` is a message (the same on every rank given the same
    batch) or None; `fields` describe the batch for the ranks' agreement."""
    n, _ = cp_size_and_rank(group)
    batch = dict(batch)
    fields = {}
    ids = batch.get("input_ids")
    if ids is None:
        ids = batch.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return {}, "the batch needs input_ids (B, S) (or inputs_embeds (B, S, H)) as a tensor", fields
    bsz, seq = ids.shape[0], ids.shape[1]
    fields["shape"] = str(tuple(ids.shape))
    if "input_ids" in batch:
        fields["input_ids"] = digest(batch["input_ids"].detach().to("cpu").flatten().tolist())
    if batch.get("past_key_values") is not None:
        return {}, "past_key_values: a KV cache cannot be sharded over the sequence; pass none (use_cache=False)", fields
    if batch.get("use_cache"):
        return {}, "use_cache=True: a KV cache cannot be sharded over the sequence; pass use_cache=False (or leave it out)", fields
    m = layout.multiple(n)
    if seq % m != 0:
        return {}, (f"sequence length {seq}: {layout!r} over {n} ranks needs a multiple of {m}; pad the batch to a "
                    f"multiple of {m} (pad_to_multiple_of={m} in the collator, with attention_mask or -100 labels)"), fields
    if isinstance(layout, DocZigzag):
        return {}, "layout=DocZigzag carries fixed documents; use dtcp.Zigzag() or dtcp.Contiguous() here", fields

    starts: list[list[int]] = [[] for _ in range(bsz)]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ids.device).unsqueeze(0)
    elif not _is_seq_tensor(pos, bsz, seq):
        return {}, f"position_ids must be (B, S) or (1, S) with S={seq}; got {tuple(pos.shape)}", fields
    else:
        rows = _boundaries_from_positions(pos)
        starts = [list(r) for r in (rows if len(rows) == bsz else rows * bsz)]
    am = batch.pop("attention_mask", None)
    if am is not None:
        if not (isinstance(am, torch.Tensor) and am.dim() == 2 and tuple(am.shape) == (bsz, seq)):
            return {}, (f"attention_mask must be the 2-D padding mask (B, S)=({bsz}, {seq}); got "
                        f"{tuple(am.shape) if isinstance(am, torch.Tensor) else type(am).__name__}"), fields
        pad_rows, err = _boundaries_from_padding(am)
        if err:
            return {}, err, fields
        starts = [s + p for s, p in zip(starts, pad_rows)]
    cu = batch.pop("cu_seq_lens_q", None)
    if cu is not None:
        if bsz != 1 or not isinstance(cu, torch.Tensor) or cu.dim() != 1:
            return {}, (f"cu_seq_lens_q (DataCollatorWithFlattening's return_flash_attn_kwargs) needs one packed row "
                        f"(B=1) and a 1-D tensor; got B={bsz}"), fields
        vals = cu.detach().to("cpu").tolist()
        if vals[0] != 0 or vals[-1] != seq or any(b < a for a, b in zip(vals, vals[1:])):
            return {}, f"cu_seq_lens_q must run from 0 to S={seq}, non-decreasing; got {vals}", fields
        starts[0] = starts[0] + [v for v in vals[1:-1] if 0 < v < seq]
    for key in _DROPPED_KEYS:
        batch.pop(key, None)

    labels = batch.pop("labels", None)
    shift = batch.pop("shift_labels", None)
    if shift is None and labels is not None:
        if not _is_seq_tensor(labels, bsz, seq):
            return {}, f"labels must be (B, S) with S={seq}; got {tuple(labels.shape)}", fields
        # HF's ForCausalLMLoss shift, done on the whole sequence (not inside each shard)
        shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if shift is not None:
        if not _is_seq_tensor(shift, bsz, seq):
            return {}, f"shift_labels must be (B, S) with S={seq}; got {tuple(shift.shape)}", fields
        if am is not None:  # a padding row's output is no attention's business: ignore what it predicts
            shift = shift.masked_fill(am.to(shift.device) == 0, IGNORE_INDEX)
        if batch.get("num_items_in_batch") is None:
            batch["num_items_in_batch"] = (shift != IGNORE_INDEX).sum()
        batch["shift_labels"] = shift
    batch["position_ids"] = pos
    batch["use_cache"] = False
    cu_t = _cu_seqlens(starts, seq)
    fields["cu_seqlens"] = "None" if cu_t is None else digest(cu_t.tolist())

    inputs = {}
    for key, value in batch.items():
        if key in _SEQ_KEYS and isinstance(value, torch.Tensor) and _is_seq_tensor(value, bsz, seq):
            inputs[key] = layout.shard(value, group, 1).clone(memory_format=torch.contiguous_format)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq and key != "num_items_in_batch":
            return {}, (f"batch[{key!r}] has the sequence length {seq} along dim 1 but is not a key the block knows "
                        f"how to shard ({', '.join(_SEQ_KEYS)}, labels, attention_mask): shard it or leave it out"), fields
        else:
            inputs[key] = value
    if "shift_labels" in inputs:
        inputs["labels"] = inputs["shift_labels"]  # HF computes the loss only when labels is given; shift_labels wins
    if cu_t is not None:
        inputs["cu_seq_lens_q"] = cu_t
    return inputs, None, fields


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
    layout: Union[Layout, str] = DEFAULT_LAYOUT,
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
            keyword. S must be a multiple of ``layout.multiple(N)``.
        mesh_dim: the cp dim's name when `mesh` is N-D.
        layout: dtcp.Zigzag() (default; balanced causal work) or dtcp.Contiguous() (fewest
            rounds for sliding windows), dtcp.Striped(b).
        backend, strategy: as in dtcp.ring_attention.
        check_batch: agree on a digest of the batch across the cp ranks (one host round trip
            through the store): a batch that differs between cp ranks raises on every rank.

    Yields:
        `HFContextParallel`: ``inputs`` (pass ``model(**cp.inputs)``), ``group``, ``layout``,
        ``gather(local, dim)``, ``loss(local_loss)``.
    """
    global _ACTIVE
    if isinstance(mesh_dim, (tuple, list)):
        raise ValueError(f"mesh_dim={tuple(mesh_dim)!r}: dtcp.integrations.transformers takes one cp dim (a 1-D cp "
                         "group); 2-D CP meshes (strategy='hybrid') are not supported here yet. Pass one dim name.")
    _, pg = resolve_cp_mesh(mesh, mesh_dim)
    layout = layout_from_spec(layout)
    error = check_model(model)
    inputs, fields = {}, {}
    if error is None and batch is not None:
        try:
            inputs, error, fields = prepare_batch(batch, pg, layout)
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
    if _ACTIVE is not None:
        raise RuntimeError("dtcp.integrations.transformers.context_parallel blocks do not nest")
    state = _state_for(pg, layout, backend, strategy)
    state.seen = False
    marker = _grad_marker(model)
    _ACTIVE = state
    clean = False
    try:
        # Direct F.scaled_dot_product_attention calls (outside transformers' interface) become exact
        # ring attention too, instead of attending to the local shard.
        with _sdpa_context_parallel(mesh, mesh_dim=mesh_dim, layout=layout, backend=backend, strategy=strategy):
            yield HFContextParallel(mesh, pg, layout, inputs)
        clean = True
    finally:
        _ACTIVE = None
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


# ---- the Trainer path (transformers.Trainer, TRL's SFTTrainer): dtcp/integrations/transformers/trainer.py ----
from .trainer import ContextParallelConfig, ContextParallelMixin, with_context_parallel  # noqa: E402,F401

__all__ += ["ContextParallelConfig", "ContextParallelMixin", "with_context_parallel"]
