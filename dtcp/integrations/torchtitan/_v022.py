"""dtcp as the context parallelism of torchtitan 0.2.2, chosen in the job's TOML file.

A job switches to dtcp by naming this module and a ``*_dtcp`` model, and sets dtcp's options in
a ``[dtcp]`` section::

    [job]
    custom_config_module = "dtcp.integrations.torchtitan"   # adds the [dtcp] section

    [experimental]
    custom_import = "dtcp.integrations.torchtitan"          # registers the train spec "llama3_dtcp"

    [model]
    name = "llama3_dtcp"            # stock torchtitan llama3; dtcp runs its context parallelism
    flavor = "debugmodel"           # or "debugmodel_varlen_attn" for document masking

    [parallelism]
    context_parallel_degree = 2

    [dtcp]
    layout = "zigzag"               # contiguous | zigzag | striped | striped:<block>
    backend = "auto"                # auto | fa4 | cudnn | flash | fa2 | flex | cpu_flash | math
    window_size = -1                # causal sliding window: keys up to this many tokens back; -1: none
    strategy = "auto"               # auto | ring | allgather | ulysses

What "llama3_dtcp" changes against torchtitan's "llama3" (everything else is the stock train
spec: model, FSDP/TP/PP/AC/compile, data, loss, optimizer, checkpoints):

* parallelize: every attention module's SDPA/varlen wrapper (``inner_attention``) becomes a
  `DtcpRingAttention` over the ``cp`` dimension of torchtitan's device mesh, and torchtitan's
  ``apply_cp_to_attention_module`` (PyTorch's experimental CP) is not applied. FSDP shards over
  the ``fsdp`` mesh (dp_shard x cp) and TP over ``tp`` exactly as torchtitan does; compiled
  blocks see one custom op per attention call and no graph breaks.
* inputs: torchtitan's trainer shards (inputs, labels, positions) through
  ``torchtitan.distributed.context_parallel.cp_shard``; for the cp mesh that dtcp owns this
  shards them with the ``[dtcp] layout`` instead of torchtitan's load balancer (so
  ``[parallelism] context_parallel_load_balancer`` is ignored), and RoPE sees global positions.
* document masking: flavors with ``attn_type = "varlen"`` (torchtitan refuses them under CP) get
  the packed batch's document boundaries, found from EOS tokens by torchtitan's own
  ``create_varlen_metadata_for_document`` on the whole (unsharded) batch before the inputs are
  sharded, so identical on every cp rank. They cover the batch flattened to B*S tokens, which
  dtcp's ``cu_seqlens`` takes as they are (each row with its own documents): one
  ``dtcp.ring_attention`` call per layer for the whole batch.
* sliding window: ``[dtcp] window_size = W`` is ``dtcp.ring_attention(window_size=(W, 0))``
  in every attention call (causal, with or without document masking).

With ``context_parallel_degree = 1`` the spec is exactly torchtitan's, except with a
``[dtcp] window_size``: torchtitan's attention has no window, so then the attention runs through
dtcp on a one-rank group (the same op and mask as under CP).
"""

# No `from __future__ import annotations` here: tyro (torchtitan's CLI parser) evaluates the
# annotations of the [dtcp] dataclasses, and string annotations would not resolve.
import copy
import dataclasses
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _patches

_patches.make_torchtitan_importable()

from torchtitan.models.attention import (  # noqa: E402
    FlexAttentionWrapper,
    ScaledDotProductAttentionWrapper,
    VarlenAttentionWrapper,
    VarlenMetadata,
)
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

import dtcp  # noqa: E402
from ..._groups import group_size  # noqa: E402
from ...kernels import KERNELS  # noqa: E402
from ...layouts import Auto, Balanced, DocZigzag, Layout, layout_from_spec  # noqa: E402
from ...plan import KV_EXCHANGES, STRATEGIES  # noqa: E402

__all__ = [
    "Dtcp",
    "JobConfig",
    "DtcpOptions",
    "DtcpRingAttention",
    "dtcp_options",
    "apply_dtcp_to_attention",
    "dtcp_train_spec",
]


# ---- the [dtcp] section of the job config ------------------------------------------------------
@dataclass
class Dtcp:
    layout: str = "zigzag"
    """How each sequence is split over the cp ranks: "contiguous", "zigzag" (balanced causal
    work) or "striped" / "striped:<block>". The sequence length must be a multiple of 2*cp
    (zigzag), cp (contiguous) or cp*block (striped)."""

    backend: str = "auto"
    """Local attention kernel: "auto" (fastest that serves the request), "flash", "cudnn",
    "cpu_flash" or "math"."""

    window_size: int = -1
    """Sliding window: each token attends to itself and at most this many tokens before it.
    -1 means no window (plain causal attention)."""

    strategy: str = "auto"
    """How the work is spread over the cp ranks (dtcp.ring_attention's `strategy`): "ring"
    (overlapped ring, for long sequences), "allgather" (one all-gather per attention call;
    contiguous and zigzag layouts), "ulysses" (all-to-all over heads: n_heads must be a multiple
    of the cp degree) or "auto" (dtcp's cost model on GPUs, the ring on CPU). "hybrid" needs a 2-D
    cp mesh, which torchtitan's cp dim is not."""

    kv_exchange: str = ""
    """Deprecated alias of `strategy` ("auto", "ring", "allgather"); "" = unset."""


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``job.custom_config_module``."""

    dtcp: Dtcp = field(default_factory=Dtcp)


@dataclass(frozen=True)
class DtcpOptions:
    """The validated [dtcp] section."""

    layout: Layout
    backend: str
    window_size: Optional[tuple[int, int]]  # (left, right) for dtcp.ring_attention, None: no window
    strategy: str = "auto"


def dtcp_options(job_config) -> DtcpOptions:
    """Validate the job's [dtcp] section (defaults where the job has none)."""
    section = getattr(job_config, "dtcp", None) or Dtcp()
    try:
        layout = layout_from_spec(section.layout)
    except (TypeError, ValueError) as e:
        raise ValueError(f"[dtcp] layout = {section.layout!r}: {e}") from None
    if isinstance(layout, (Auto, Balanced, DocZigzag)):
        raise ValueError(f"[dtcp] layout = {section.layout!r}: torchtitan 0.2.2 shards through one layout per cp group; "
                         "use 'zigzag', 'contiguous' or 'striped' here ('auto', Balanced documents per batch, is in the "
                         "torchtitan 0.3 integration)")
    backends = ["auto", *sorted(KERNELS)]
    if section.backend not in backends:
        raise ValueError(f"[dtcp] backend = {section.backend!r}: use one of {backends}")
    window = section.window_size
    if not isinstance(window, int) or isinstance(window, bool) or window < -1:
        raise ValueError(f"[dtcp] window_size = {window!r}: use -1 (no window) or a number of tokens >= 0")
    strategy = getattr(section, "strategy", "auto")
    one_dim = [s for s in STRATEGIES if s != "hybrid"]
    if strategy not in one_dim:
        raise ValueError(f"[dtcp] strategy = {strategy!r}: use one of {one_dim} (torchtitan's cp mesh dim is 1-D, "
                         "so 'hybrid' is not available here)")
    kv_exchange = getattr(section, "kv_exchange", "") or ""
    if kv_exchange:
        warnings.warn("[dtcp] kv_exchange is deprecated: use [dtcp] strategy (the same values)", DeprecationWarning,
                      stacklevel=2)
        if kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"[dtcp] kv_exchange = {kv_exchange!r}: use one of {list(KV_EXCHANGES)} (or, better, "
                             "[dtcp] strategy)")
        if strategy not in ("auto", kv_exchange):
            raise ValueError(f"[dtcp] strategy = {strategy!r} and kv_exchange = {kv_exchange!r} disagree: set "
                             "strategy only")
        strategy = kv_exchange
    return DtcpOptions(layout=layout, backend=section.backend, window_size=(window, 0) if window >= 0 else None,
                       strategy=strategy)


# ---- attention ---------------------------------------------------------------------------------
class DtcpRingAttention(nn.Module):
    """Drop-in for torchtitan's ScaledDotProductAttentionWrapper / VarlenAttentionWrapper that
    runs dtcp's ring over the context-parallel group. q, k, v: (B, H, S_local, D), this rank's
    tokens in the layout's order."""

    def __init__(self, group, options: DtcpOptions, document_masking: bool = False):
        super().__init__()
        self.group = group
        self.layout = options.layout
        self.backend = options.backend
        self.window_size = options.window_size
        self.strategy = options.strategy
        self.document_masking = document_masking
        self.cp_size = group_size(group)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_masks: Optional[VarlenMetadata] = None,
        *,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        kwargs = dict(layout=self.layout, is_causal=is_causal, scale=scale, backend=self.backend,
                      strategy=self.strategy)
        if self.window_size is not None:
            kwargs["window_size"] = self.window_size
        if not self.document_masking:
            if attention_masks is not None:
                raise TypeError(f"DtcpRingAttention got attention_masks of type {type(attention_masks).__name__}")
            return dtcp.ring_attention(q, k, v, self.group, enable_gqa=enable_gqa, **kwargs)

        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(
                f"DtcpRingAttention with document masking needs torchtitan's VarlenMetadata; got "
                f"{type(attention_masks).__name__}"
            )
        enable_gqa = q.shape[1] != k.shape[1]  # torchtitan's varlen call does not pass it
        # Global boundaries over the batch flattened to B*S tokens, built from the unsharded batch
        # (the same on every cp rank): dtcp reads them as each row's own documents.
        cu = attention_masks.cu_seq_q
        out = dtcp.ring_attention(q, k, v, self.group, enable_gqa=enable_gqa, cu_seqlens=cu, **kwargs)
        # torchtitan's varlen path views the output as (B, S, -1): (B, S_local, H, D) here.
        return out.transpose(1, 2).contiguous()

    def extra_repr(self) -> str:
        mask = "document" if self.document_masking else "causal"
        return (
            f"layout={self.layout.spec()}, backend={self.backend}, window_size={self.window_size}, "
            f"strategy={self.strategy}, mask={mask}, cp={self.cp_size}"
        )


def apply_dtcp_to_attention(model: nn.Module, cp_group, options: DtcpOptions) -> int:
    """Replace every torchtitan SDPA/varlen attention wrapper in `model` by a DtcpRingAttention
    over `cp_group`. Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        inner = getattr(parent, "inner_attention", None)
        if inner is None:
            continue
        if isinstance(inner, FlexAttentionWrapper):
            raise ValueError(
                "dtcp serves torchtitan flavors with attn_type 'sdpa' (causal) and 'varlen' "
                "(document masking); this model uses flex attention. Pick an sdpa or varlen flavor."
            )
        if isinstance(inner, ScaledDotProductAttentionWrapper):
            document_masking = False
        elif isinstance(inner, VarlenAttentionWrapper):
            document_masking = True
        else:
            continue
        parent.inner_attention = DtcpRingAttention(cp_group, options, document_masking)
        replaced += 1
    return replaced


# ---- input sharding ----------------------------------------------------------------------------
# The layout of each cp group dtcp owns, keyed by the group object (a group destroyed and made
# again is a new object and no longer dtcp's until parallelize runs for it).
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _dtcp_cp_shard(cp_mesh, inputs, attention_masks, load_balancer_type="headtail", input_seq_dim=1):
    """torchtitan's cp_shard for the cp meshes dtcp owns: each tensor of `inputs` (inputs,
    labels, positions) is sharded along `input_seq_dim` with the dtcp layout; document
    boundaries (VarlenMetadata) stay global, as dtcp's varlen ring takes them."""
    group = cp_mesh.get_group()
    layout = _LAYOUTS.get(group)
    if layout is None:
        return _dtcp_cp_shard.torchtitan_cp_shard(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim)
    if attention_masks is not None and not isinstance(attention_masks, VarlenMetadata):
        raise TypeError(
            f"dtcp shards causal and document-masked (varlen) batches; got attention masks of type "
            f"{type(attention_masks).__name__}"
        )
    sharded = tuple(layout.shard(t, group, dim=input_seq_dim).contiguous() for t in inputs)
    return sharded, attention_masks


def _own_cp_mesh(cp_mesh, layout: Layout) -> None:
    _LAYOUTS[cp_mesh.get_group()] = layout
    _patches.patch_torchtitan_cp_shard(_dtcp_cp_shard)


# ---- the train spec ----------------------------------------------------------------------------
def _skip_torchtitan_cp(attention_modules, cp_mesh, attention_type) -> None:
    """Stands in for torchtitan's apply_cp_to_attention_module while a dtcp spec parallelizes."""
    others = [type(m).__name__ for m in attention_modules if not isinstance(m, DtcpRingAttention)]
    if others:
        raise RuntimeError(f"dtcp did not replace these attention modules: {sorted(set(others))}")
    logger.info(f"Applied dtcp ring attention to {len(attention_modules)} attention modules")


def _apply_dtcp_without_cp(model: nn.Module, options: DtcpOptions) -> None:
    """CP=1 with a [dtcp] window: torchtitan's SDPA and varlen wrappers have no sliding window, so
    attention runs through the same dtcp op on a one-rank group of this process (whole sequences,
    nothing sent). Without a window, CP=1 stays torchtitan's own attention."""
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    # One rank holds the whole sequence in order whatever the layout; contiguous has no
    # divisibility rule for seq_len.
    n = apply_dtcp_to_attention(model, group, dataclasses.replace(options, layout=dtcp.Contiguous()))
    if n == 0:
        raise RuntimeError(f"dtcp found no torchtitan attention wrapper to replace in {type(model).__name__}")
    logger.info(f"dtcp: context_parallel_degree = 1 with [dtcp] window_size: dtcp attention (one rank, "
                f"window {options.window_size}) in {n} attention modules")


def _dtcp_parallelize(base_parallelize):
    def parallelize(model: nn.Module, parallel_dims, job_config, *args, **kwargs):
        options = dtcp_options(job_config)
        if not parallel_dims.cp_enabled:
            if options.window_size is not None:
                _apply_dtcp_without_cp(model, options)
            return base_parallelize(model, parallel_dims, job_config, *args, **kwargs)
        cp_mesh = parallel_dims.get_mesh("cp")
        options.layout.check(job_config.training.seq_len, cp_mesh.size())
        n = apply_dtcp_to_attention(model, cp_mesh.get_group(), options)
        if n == 0:
            raise RuntimeError(f"dtcp found no torchtitan attention wrapper to replace in {type(model).__name__}")
        _own_cp_mesh(cp_mesh, options.layout)
        logger.info(
            f"dtcp: context parallelism over cp={cp_mesh.size()} with layout {options.layout.spec()}, "
            f"backend {options.backend}, window {options.window_size}, strategy {options.strategy}"
        )
        with _patches.replaced_global(base_parallelize, "apply_cp_to_attention_module", _skip_torchtitan_cp):
            return base_parallelize(model, parallel_dims, job_config, *args, **kwargs)

    parallelize.__name__ = f"dtcp_{base_parallelize.__name__}"
    parallelize.__qualname__ = parallelize.__name__
    return parallelize


_ARGS_CLASSES: dict[type, type] = {}


def _dtcp_model_args(args):
    """A copy of `args` whose update_from_config (called by the trainer before it builds the
    model) validates the [dtcp] section and lets varlen (document-masked) flavors through under
    CP, which torchtitan 0.2.2 refuses and dtcp serves."""
    base = type(args)
    cls = _ARGS_CLASSES.get(base)
    if cls is None:

        def update_from_config(self, job_config, **kwargs):
            dtcp_options(job_config)  # validate [dtcp] early, whatever the cp degree
            if job_config.parallelism.context_parallel_degree > 1 and getattr(self, "attn_type", None) == "varlen":
                self.attn_type = "sdpa"  # hide it from torchtitan's own refusal
                try:
                    return base.update_from_config(self, job_config, **kwargs)
                finally:
                    self.attn_type = "varlen"
            return base.update_from_config(self, job_config, **kwargs)

        cls = type(f"Dtcp{base.__name__}", (base,), {"update_from_config": update_from_config})
        cls = dataclass(cls)
        _ARGS_CLASSES[base] = cls
    return cls(**{f.name: copy.deepcopy(getattr(args, f.name)) for f in dataclasses.fields(args) if f.init})


def dtcp_train_spec(base_name: str = "llama3") -> TrainSpec:
    """torchtitan's train spec `base_name` with dtcp as its context parallelism."""
    base = get_train_spec(base_name)
    return dataclasses.replace(
        base,
        model_args={flavor: _dtcp_model_args(a) for flavor, a in base.model_args.items()},
        parallelize_fn=_dtcp_parallelize(base.parallelize_fn),
    )


register_train_spec("llama3_dtcp", dtcp_train_spec("llama3"))
