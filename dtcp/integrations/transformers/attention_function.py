"""The attention and mask functions registered with transformers under the name ``"dtcp"``
(``attn_implementation="dtcp"``): inside a `context_parallel` block exact ring attention over
the whole sequence, outside one HF's eager attention over HF's own masks."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from ...api import ring_attention
from . import _state

ATTN_IMPLEMENTATION = "dtcp"
_UNSET = object()   # sliding_window not passed at all (as opposed to passed as None: a full layer)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
              sliding_window: Any = _UNSET, softcap: Optional[float] = None,
              s_aux: Optional[torch.Tensor] = None, is_causal: Optional[bool] = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``attn_implementation="dtcp"``.

    query (B, Hq, S, D), key/value (B, Hkv, S, D) with RoPE applied; returns ((B, S, Hq, Dv), None).
    Inside `context_parallel` S is this rank's shard and the result is exact attention over the
    whole sequence; outside it is HF's eager attention (HF's own masks)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    state = _state.ACTIVE
    if state is None:
        if sliding_window is _UNSET:
            sliding_window = None
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
    sliding_window = _sliding_window(module, sliding_window, state)
    if sliding_window is not None:
        if not causal:
            raise ValueError(
                f"sliding_window={sliding_window} with is_causal=False (bidirectional sliding attention) is not "
                "supported by attn_implementation='dtcp' under context parallelism; use a causal model."
            )
        # HF: key j is visible to query i when i - W < j <= i (W keys, the query's own included):
        # dtcp's window_size=(W - 1, 0).
        window = (int(sliding_window) - 1, 0)
    cu = _boundaries(state, query, kwargs.get("cu_seq_lens_q"))
    out = ring_attention(
        query, key, value, state.group, layout=state.layout, is_causal=bool(causal), scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], backend=state.backend, window_size=window, cu_seqlens=cu,
        strategy=state.strategy, softcap=softcap or None, sinks=s_aux, chunk_size=_chunk_size(module),
    )
    state.seen = True
    return out.transpose(1, 2).contiguous(), None


def _sliding_window(module: torch.nn.Module, passed: Any, state: _state._Active) -> Optional[int]:
    """The layer's sliding window: the one the model passed (None included: a full layer), else
    the one of the masks the model built. Some models (PhiMoE) put their window only into the mask
    (masking_utils' create_sliding_window_causal_mask) and pass none to the attention function,
    which dtcp does not take masks from; others (Moshi) carry ``config.sliding_window`` and never
    use it. The mask function records each mask's window (`mask`); when all the masks the model
    built agree, that is the window; when they differ and the layer does not say which it uses,
    dtcp cannot tell: raise."""
    if passed is not _UNSET:
        return passed
    if _chunk_size(module) is not None:
        return None
    windows = set(state.mask_windows)
    if len(windows) > 1:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) called attn_implementation='dtcp' "
            f"without sliding_window=, while the model built masks with different windows {sorted(windows, key=str)} "
            "(None: full causal): dtcp takes the window from the attention call, not from the mask, and cannot tell "
            "which this layer uses. Pass sliding_window= to the attention function in the model's attention module."
        )
    return next(iter(windows), None)


def _chunk_size(module: torch.nn.Module) -> Optional[int]:
    """The chunk length of a chunked-attention layer (Llama 4: ``config.layer_types[layer_idx] ==
    "chunked_attention"``, ``config.attention_chunk_size``), else None. transformers passes the
    chunking to its attention functions only as a mask, which dtcp does not take: the layer type is
    read from the module's config (`block.check_model` checks that every chunked layer's module
    exposes it)."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] == "chunked_attention":
        return int(config.attention_chunk_size)
    return None


def _boundaries(state: _state._Active, query: torch.Tensor, cu_kwarg: Optional[torch.Tensor]):
    """The global document boundaries of this attention call: the block's (its state, never a model
    keyword: models that do not forward **kwargs to their attention, and wrappers that copy them,
    FSDP2 moving them to the GPU, would lose or change them). A ``cu_seq_lens_q`` keyword inside a
    block that sharded a batch is the user's own: refused. Without a batch given to the block, the
    keyword."""
    if state.shard is None:
        return cu_kwarg
    bsz, local = state.shard
    if query.shape[0] != bsz or query.shape[2] != local:
        raise ValueError(
            f"attn_implementation='dtcp' inside dtcp.integrations.transformers.context_parallel got query of batch "
            f"{query.shape[0]} and length {query.shape[2]}, but the block sharded a batch of {bsz} rows into "
            f"{local} tokens per rank: this attention call is not over the block's shard (a second sequence, a "
            "cache, or inputs other than cp.inputs), so dtcp cannot say which tokens it attends to across ranks. "
            "Call model(**cp.inputs) with the batch given to the block, and nothing else inside the block."
        )
    if cu_kwarg is not None:
        raise ValueError(
            "attn_implementation='dtcp' inside dtcp.integrations.transformers.context_parallel got cu_seq_lens_q "
            "that are not the block's document boundaries (the block hands dtcp its own, not through the model): "
            "pass the packed batch (position_ids, cu_seq_lens_q or attention_mask) to the block, which computes the "
            "global boundaries, and call model(**cp.inputs) without adding cu_seq_lens_q of your own."
        )
    return state.cu_seqlens


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
    state = _state.ACTIVE
    if state is None:
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    # masking_utils passes local_size=sliding_window for sliding masks, =chunk_size for chunked
    # ones and nothing for causal ones: record the window (the attention function needs it for
    # layers that get their window only from the mask)
    local = kwargs.get("local_size")
    config = kwargs.get("config")
    chunked = local is not None and local == getattr(config, "attention_chunk_size", None) and \
        "chunked_attention" in (getattr(config, "layer_types", None) or ())
    if not chunked:
        state.mask_windows = state.mask_windows + (local,)
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
