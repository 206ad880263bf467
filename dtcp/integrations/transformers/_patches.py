"""The transformers internals dtcp's integration relies on, each with the release it was checked on.

Checked on transformers 5.18.0, 5.23.0 and 5.24.0 (the oldest and newest releases accepted, and
the one the extra pins by default) with torch 2.13.0+cpu: tests/test_transformers.py passes on each
(``pip install --no-deps --target DIR transformers==X`` put first on PYTHONPATH). 5.17 and older need
huggingface-hub < 2 and tokenizers <= 0.23.0 and were not run. Nothing in transformers is
monkeypatched; the integration registers an attention function and a mask function under the name
"dtcp" and relies on these behaviours (tests/test_transformers.py checks each of them):

* ``AttentionInterface.register(name, fn)`` / ``AttentionMaskInterface.register(name, fn)``
  (``modeling_utils.py``, ``masking_utils.py``): class-level registries every model consults;
  the mask preprocessing reads ``AttentionMaskInterface._global_mapping`` (masking_utils.py,
  ``_preprocess_mask_arguments``), so the mask function is registered with the classmethod.
* Each decoder model calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
  eager_attention_forward)(module, q, k, v, attention_mask, dropout=, scaling=, [sliding_window=,
  softcap=, s_aux=,] **kwargs)`` with q (B, Hq, S, D), k/v (B, Hkv, S, D) after RoPE, and
  reshapes the returned (B, S, Hq, Dv) output; ``**kwargs`` carries what the model was called
  with (``cu_seq_lens_q``, ``shift_labels``, ``num_items_in_batch``, ``position_ids``).
* ``sliding_window=W`` means key j is visible to query i when ``i - W < j <= i``
  (masking_utils.sliding_window_overlay + causal_mask_function): dtcp's ``window_size=(W-1, 0)``.
* ``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
  shift_labels=None)`` (loss/loss_utils.py) uses ``shift_labels`` as they are when given (no
  shift inside the shard) and divides the summed loss by ``num_items_in_batch`` when given.
  The model computes the loss only when ``labels`` is not None.
* ``find_packed_sequence_indices`` (masking_utils.py): a new document starts wherever
  ``position_ids`` do not step by +1; the block uses the same rule on the full position ids.
* Layer kinds the attention function reads from the attention module, because transformers
  hands them to attention functions only as a mask (5.18-5.24): ``module.config`` and
  ``module.layer_idx``; ``config.layer_types[i]`` in {"full_attention", "sliding_attention",
  "chunked_attention"}; ``config.attention_chunk_size`` (Llama 4: ``chunked_causal_mask_function``,
  causal within chunks). The mask interface is called with ``local_size=sliding_window`` by
  ``create_sliding_window_causal_mask``, ``local_size=chunk_size`` by
  ``create_chunked_causal_mask`` and without it by ``create_causal_mask`` (and ``config=``):
  the window of layers that pass no ``sliding_window=`` (PhiMoE).
* Llama 4's ``attn_temperature_tuning`` (models/llama4, Llama4TextAttention): NoPE layers scale
  queries by ``log1p(floor((arange(S) + 1) / floor_scale)) * attn_scale + 1`` over the forward's
  own tokens; 1 for every position below ``floor_scale - 1``.
* RoBERTa-family embeddings (models/roberta and copies): without ``position_ids`` they number
  tokens with their own ``create_position_ids_from_input_ids(input_ids, padding_idx)``
  (``padding_idx + 1 + cumsum`` of non-padding tokens); the block calls it on the full batch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ">=5.18,<5.25"
_LOW, _HIGH = (5, 18), (5, 25)


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def check_transformers_version() -> None:
    """Raise ImportError naming the fix when transformers is missing or outside the tested range."""
    try:
        found = version("transformers")
    except PackageNotFoundError:
        raise ImportError(
            'dtcp.integrations.transformers needs transformers: pip install "dtcp[transformers]" '
            f"(transformers{SUPPORTED})"
        ) from None
    if not _LOW <= _release(found)[:2] < _HIGH:
        raise ImportError(
            f"dtcp.integrations.transformers is tested with transformers{SUPPORTED}; found {found}. "
            f'Install a tested release: pip install "dtcp[transformers]"'
        )
