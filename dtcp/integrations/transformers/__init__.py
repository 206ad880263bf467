"""dtcp as the context parallelism of Hugging Face transformers causal LMs (transformers >=5.18,<5.25,
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
  and the batch's global document boundaries, which the block hands it directly (not through the
  model's keywords, which wrappers such as FSDP2 copy onto the GPU). Outside a block
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

Modules: ``attention_function.py`` (the attention and mask functions), ``batch.py`` (batch
preparation), ``block.py`` (the model checks, the block, ``sum_gradients``), ``_state.py`` (what
the block hands the attention function). transformers internals this relies on are listed, with
the versions checked, in ``_patches.py``.
"""

from __future__ import annotations

from . import _patches

_patches.check_transformers_version()

from .attention_function import ATTN_IMPLEMENTATION, attention, mask  # noqa: E402  (registers "dtcp")
from .batch import prepare_batch  # noqa: E402
from .block import HFContextParallel, check_model, context_parallel, sum_gradients  # noqa: E402

SUPPORTED_TRANSFORMERS = _patches.SUPPORTED

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

# the Trainer path (transformers.Trainer, TRL's SFTTrainer): dtcp/integrations/transformers/trainer.py
from .trainer import ContextParallelConfig, ContextParallelMixin, with_context_parallel  # noqa: E402

__all__ += ["ContextParallelConfig", "ContextParallelMixin", "with_context_parallel"]
