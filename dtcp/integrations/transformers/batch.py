"""Batch preparation: the model's keyword arguments for one cp rank, from the full batch (global
positions, labels shifted on the whole sequence, a global ``num_items_in_batch``, global document
boundaries from packing and padding), sharded in the block's layout."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from ...api import resolve_auto
from ...comm.guard import digest, tensor_digest
from ...layouts import Auto, Balanced, DocZigzag, Layout
from ..._groups import cp_size_and_rank

IGNORE_INDEX = -100
_SEQ_KEYS = ("input_ids", "inputs_embeds", "position_ids", "shift_labels", "token_type_ids")
_DROPPED_KEYS = ("max_length_q", "max_length_k", "seq_idx", "cu_seq_lens_k")


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


def _model_positions(model, batch: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The position ids `model` would make itself from the full batch, for models whose embeddings
    do not count from 0 (RoBERTa's family: ``padding_idx + 1 + arange``, padding tokens at
    ``padding_idx``, made by the embeddings' own ``create_position_ids_from_input_ids`` /
    ``create_position_ids_from_inputs_embeds``). None for every other model (``arange(S)``)."""
    if model is None:
        return None
    for module in model.modules():
        pad = getattr(module, "padding_idx", None)
        make = getattr(module, "create_position_ids_from_input_ids", None)
        if callable(make) and isinstance(pad, int):
            if isinstance(batch.get("input_ids"), torch.Tensor):
                return make(batch["input_ids"], pad)
            make_embeds = getattr(module, "create_position_ids_from_inputs_embeds", None)
            if callable(make_embeds) and isinstance(batch.get("inputs_embeds"), torch.Tensor):
                return make_embeds(batch["inputs_embeds"], pad)
    return None


def prepare_batch(batch: Mapping[str, Any], group, layout: Layout,
                  model=None, strategy: str = "auto") -> tuple[dict, Optional[str], dict, Layout]:
    """The model's keyword arguments for this rank, from the full batch (see `context_parallel`).
    `model` (optional): the model, for position ids it makes its own way (`_model_positions`).
    `layout` may be `Auto()`: resolved here from the batch's documents (for the attention calls'
    `strategy`: dtcp.api.resolve_auto).

    Returns (inputs, error, fields, layout): `error` is a message (the same on every rank given the
    same batch) or None; `fields` describe the batch for the ranks' agreement; `layout` is the one
    the inputs were sharded with."""
    n, _ = cp_size_and_rank(group)
    batch = dict(batch)
    fields = {}
    ids = batch.get("input_ids")
    if ids is None:
        ids = batch.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return {}, "the batch needs input_ids (B, S) (or inputs_embeds (B, S, H)) as a tensor", fields, layout
    bsz, seq = ids.shape[0], ids.shape[1]
    fields["shape"] = str(tuple(ids.shape))
    if "input_ids" in batch:
        fields["input_ids"] = tensor_digest(batch["input_ids"])
    if batch.get("past_key_values") is not None:
        return {}, "past_key_values: a KV cache cannot be sharded over the sequence; pass none (use_cache=False)", fields, layout
    if batch.get("use_cache"):
        return {}, "use_cache=True: a KV cache cannot be sharded over the sequence; pass use_cache=False (or leave it out)", fields, layout
    m = layout.multiple(n)
    if seq % m != 0:
        return {}, (f"sequence length {seq}: {layout!r} over {n} ranks needs a multiple of {m}; pad the batch to a "
                    f"multiple of {m} (pad_to_multiple_of={m} in the collator, with attention_mask or -100 labels)"), fields, layout
    if isinstance(layout, (DocZigzag, Balanced)):
        return {}, (f"layout={type(layout).__name__} carries fixed documents, but each batch brings its own; use "
                    "layout='auto' (Balanced from each batch's documents), dtcp.Zigzag() or dtcp.Contiguous() "
                    "here"), fields, layout

    starts: list[list[int]] = [[] for _ in range(bsz)]
    pos = batch.get("position_ids")
    if pos is None:
        # the model would number the tokens of its forward (this rank's shard): number the whole
        # sequence instead, by the model's own rule where it has one
        pos = _model_positions(model, batch)
        if pos is None:
            pos = torch.arange(seq, device=ids.device).unsqueeze(0)
    elif not _is_seq_tensor(pos, bsz, seq):
        return {}, f"position_ids must be (B, S) or (1, S) with S={seq}; got {tuple(pos.shape)}", fields, layout
    else:
        rows = _boundaries_from_positions(pos)
        starts = [list(r) for r in (rows if len(rows) == bsz else rows * bsz)]
    am = batch.pop("attention_mask", None)
    if am is not None:
        if not (isinstance(am, torch.Tensor) and am.dim() == 2 and tuple(am.shape) == (bsz, seq)):
            return {}, (f"attention_mask must be the 2-D padding mask (B, S)=({bsz}, {seq}); got "
                        f"{tuple(am.shape) if isinstance(am, torch.Tensor) else type(am).__name__}"), fields, layout
        pad_rows, err = _boundaries_from_padding(am)
        if err:
            return {}, err, fields, layout
        starts = [s + p for s, p in zip(starts, pad_rows)]
    cu = batch.pop("cu_seq_lens_q", None)
    if cu is not None:
        if bsz != 1 or not isinstance(cu, torch.Tensor) or cu.dim() != 1:
            return {}, (f"cu_seq_lens_q (DataCollatorWithFlattening's return_flash_attn_kwargs) needs one packed row "
                        f"(B=1) and a 1-D tensor; got B={bsz}"), fields, layout
        vals = cu.detach().to("cpu").tolist()
        if vals[0] != 0 or vals[-1] != seq or any(b < a for a, b in zip(vals, vals[1:])):
            return {}, f"cu_seq_lens_q must run from 0 to S={seq}, non-decreasing; got {vals}", fields, layout
        starts[0] = starts[0] + [v for v in vals[1:-1] if 0 < v < seq]
    for key in _DROPPED_KEYS:
        batch.pop(key, None)

    labels = batch.pop("labels", None)
    shift = batch.pop("shift_labels", None)
    if shift is None and labels is not None:
        if not _is_seq_tensor(labels, bsz, seq):
            return {}, f"labels must be (B, S) with S={seq}; got {tuple(labels.shape)}", fields, layout
        # HF's ForCausalLMLoss shift, done on the whole sequence (not inside each shard)
        shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if shift is not None:
        if not _is_seq_tensor(shift, bsz, seq):
            return {}, f"shift_labels must be (B, S) with S={seq}; got {tuple(shift.shape)}", fields, layout
        if am is not None:  # a padding row's output is no attention's business: ignore what it predicts
            shift = shift.masked_fill(am.to(shift.device) == 0, IGNORE_INDEX)
        if batch.get("num_items_in_batch") is None:
            batch["num_items_in_batch"] = (shift != IGNORE_INDEX).sum()
        batch["shift_labels"] = shift
    batch["position_ids"] = pos
    batch["use_cache"] = False
    cu_t = _cu_seqlens(starts, seq)
    fields["cu_seqlens"] = "None" if cu_t is None else digest(cu_t.tolist())
    if isinstance(layout, Auto):  # Balanced for one packed row of documents, else Zigzag
        # (with the ring steps whose host time the rest of the layer hides: the cost objective's)
        layout = resolve_auto(layout, cu_t, seq, n, bsz, strategy)
        # (the placement follows dtcp.config: ranks configured apart would shard apart)
        fields["layout"] = layout.op_spec() if isinstance(layout, Balanced) else layout.spec()

    inputs = {}
    for key, value in batch.items():
        if key in _SEQ_KEYS and isinstance(value, torch.Tensor) and _is_seq_tensor(value, bsz, seq):
            inputs[key] = layout.shard(value, group, 1).clone(memory_format=torch.contiguous_format)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq and key != "num_items_in_batch":
            return {}, (f"batch[{key!r}] has the sequence length {seq} along dim 1 but is not a key the block knows "
                        f"how to shard ({', '.join(_SEQ_KEYS)}, labels, attention_mask): shard it or leave it out"), fields, layout
        else:
            inputs[key] = value
    if "shift_labels" in inputs:
        inputs["labels"] = inputs["shift_labels"]  # HF computes the loss only when labels is given; shift_labels wins
    if cu_t is not None:
        inputs["cu_seq_lens_q"] = cu_t
    return inputs, None, fields, layout
