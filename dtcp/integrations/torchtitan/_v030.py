"""dtcp as the context parallelism of torchtitan 0.3.0 (Python config functions).

A run switches to dtcp by naming one of dtcp's config functions, or any config function that
returns a `DtcpTrainer.Config`::

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module dtcp.integrations.torchtitan.configs --config llama3_debug_dtcp \\
        --parallelism.context_parallel_degree 2 --dtcp.layout zigzag --dtcp.strategy ring

`dtcp_config(config, layout=..., strategy=...)` turns any stock ``Trainer.Config`` (llama3,
qwen3, ...) into one; the ``dtcp`` section holds dtcp's options (see `DtcpSection`).

Built on 0.3's own extension points, no torchtitan code patched:

* ``Trainer.Config`` subclassed (`DtcpTrainer.Config`, whose ``build()`` makes a `DtcpTrainer`);
  ``Trainer.post_dataloading_process`` overridden (torchtitan documents it as the hook for
  subclasses): document boundaries come from the dataloader's per-document ``positions`` on the
  whole batch, then inputs, labels and positions are sharded with dtcp's layout instead of
  torchtitan's load balancer (``parallelism.context_parallel_load_balancer`` is ignored);
  ``Trainer.forward_backward_step`` runs with ``dtcp.config.layer_flops_per_token`` set to the
  model's transformer block (`layer_flops_per_token`), unless the user set it, so that
  ``strategy="auto"`` ranks each attention call as part of the step (the "step" cost objective).
* ``ModelSpec``: every inner attention config (``FlexAttention`` / ``VarlenAttention``) becomes a
  `DtcpAttention.Config`, and ``parallelize_fn`` is wrapped to bind each `DtcpAttention` to the
  ``cp`` mesh's group before torchtitan's own parallelize (FSDP2 over dp_shard x cp, AC,
  per-block torch.compile: all torchtitan's). K/V stay sharded: dtcp moves them itself, so the
  K/V all-gather that 0.3 declares on the inner attention's sharding config is dropped.

With ``spmd_backend = "partial_dtensor"`` torchtitan's parallelize calls ``apply_cp_to_forward``
on the attention modules; `_patches.replaced_global` makes that call a check that every module
is dtcp's (the one patch, version-checked). ``spmd_backend = "full_dtensor"`` (q/k/v as
DTensors) is refused with a clear error.

What 0.3's own CP refuses and dtcp serves: packed documents with the ``varlen`` backend (any
backend here: dtcp reads the documents from ``positions``), sliding windows
(``--dtcp.window_size``), the ring, Ulysses and auto strategies, and dtcp's layouts.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from torchtitan.config import Configurable  # noqa: F401  (0.3's config base; import checks the release)
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import dtcp

from . import _patches
from ..._groups import group_size
from ...api import resolve_auto
from ...kernels import KERNELS
from ...layouts import Auto, Balanced, DocZigzag, Layout, layout_from_spec
from ...plan import STRATEGIES

__all__ = [
    "DtcpAttention",
    "DtcpDocuments",
    "DtcpOptions",
    "DtcpSection",
    "DtcpTrainer",
    "document_boundaries",
    "dtcp_config",
    "dtcp_model_spec",
    "dtcp_options",
]

_ONE_DIM_STRATEGIES = [s for s in STRATEGIES if s != "hybrid"]


# ---- the `dtcp` section of the trainer config ------------------------------------------------
@dataclass(kw_only=True, slots=True)
class DtcpSection:
    """dtcp's options; on the command line ``--dtcp.<name>``."""

    layout: str = "zigzag"
    """How each sequence is split over the cp ranks: any dtcp layout spec ("zigzag",
    "contiguous", "striped", "striped:<block>", ...), or "auto": per batch, Balanced (equal
    tokens and equal causal work per rank on any document mix) when a batch is one packed row of
    documents (local_batch_size 1), else zigzag. seq_len must be a multiple of what the layout
    needs (2*cp for zigzag and auto)."""

    strategy: str = "auto"
    """"ring", "allgather", "ulysses" (n_heads a multiple of cp) or "auto" (dtcp's cost model on
    GPUs, the ring on CPU). "hybrid" needs a 2-D cp mesh, which torchtitan's cp dim is not."""

    backend: str = "auto"
    """Local attention kernel: "auto" or one of dtcp's kernels (docs/guide/backends.md)."""

    window_size: int = -1
    """Causal sliding window: each token sees itself and at most this many tokens before it
    (within its document). -1: no window."""

    documents: bool = True
    """Attend within documents only, documents read from the dataloader's per-document
    ``positions`` (a new document where the position is 0), as torchtitan 0.3's language models
    do. False: plain causal attention over the packed sequence, RoPE on global positions."""


@dataclass(frozen=True)
class DtcpOptions:
    """The validated `DtcpSection`."""

    layout: Layout
    strategy: str
    backend: str
    window_size: Optional[tuple[int, int]]  # (left, right) for dtcp.ring_attention; None: no window
    documents: bool


def dtcp_options(section: DtcpSection) -> DtcpOptions:
    """Validate the ``dtcp`` section; every error names the option and its accepted values."""
    try:
        layout = layout_from_spec(section.layout)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--dtcp.layout {section.layout!r}: {e}") from None
    if isinstance(layout, (Balanced, DocZigzag)):
        raise ValueError(f"--dtcp.layout {section.layout!r}: a layout of fixed documents, but every batch brings its "
                         "own; use 'auto' (Balanced from each batch's documents) or 'zigzag'")
    if section.strategy not in _ONE_DIM_STRATEGIES:
        raise ValueError(f"--dtcp.strategy {section.strategy!r}: use one of {_ONE_DIM_STRATEGIES} (torchtitan's cp "
                         "mesh dim is 1-D, so 'hybrid' is not available here)")
    backends = ["auto", *sorted(KERNELS)]
    if section.backend not in backends:
        raise ValueError(f"--dtcp.backend {section.backend!r}: use one of {backends}")
    w = section.window_size
    if not isinstance(w, int) or isinstance(w, bool) or w < -1:
        raise ValueError(f"--dtcp.window_size {w!r}: use -1 (no window) or a number of tokens >= 0")
    if not isinstance(section.documents, bool):
        raise ValueError(f"--dtcp.documents {section.documents!r}: use True or False")
    return DtcpOptions(layout=layout, strategy=section.strategy, backend=section.backend,
                       window_size=(w, 0) if w >= 0 else None, documents=section.documents)


# ---- attention -------------------------------------------------------------------------------
class DtcpDocuments(NamedTuple):
    """The attention masks `DtcpTrainer` hands the model: global document boundaries."""

    cu_seqlens: torch.Tensor
    """(n + 1,) int32 boundaries over the batch flattened row-major (0 ... B*S), a boundary at
    every row start; built on the whole batch, so the same on every cp rank."""
    layout: Optional[Layout] = None
    """The layout this batch was sharded with, where it is chosen per batch (``--dtcp.layout
    auto``): a Balanced without documents (the placement of `cu_seqlens`) or Zigzag; one object
    per choice, so compiled blocks see the same one every batch. None: the attention's own."""


def document_boundaries(positions: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed batch from its per-document positions.

    positions: (B, S), 0 where a document starts (torchtitan's convention; a row that starts
    inside a document starts a new one at 0 too). Returns (n + 1,) int32 on the CPU, over the
    batch flattened row-major, as `dtcp.ring_attention`'s ``cu_seqlens`` takes it."""
    B, S = positions.shape
    starts = positions.detach().cpu() == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat([flat, torch.tensor([B * S])]).to(torch.int32)


class DtcpAttention(Module):
    """Inner attention over torchtitan's cp group with `dtcp.ring_attention`.

    q, k, v: (B, L_local, N, H) this rank's tokens in the layout's order (N: local heads, GQA as
    in torchtitan); returns (B, L_local, Nq, Hv). `attention_masks`: `DtcpDocuments` or None
    (plain causal)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layout: str = "zigzag"
        strategy: str = "auto"
        backend: str = "auto"
        window_size: int = -1

        def build(self, **kwargs):
            # 0.3's model configs declare a K/V all-gather over cp on the inner attention
            # (update_from_config sets it on whatever config is there); dtcp moves K/V itself.
            instance = Module.Config.build(self, **kwargs)
            instance._sharding_config = None
            return instance

    def __init__(self, config: Config):
        super().__init__()
        options = dtcp_options(DtcpSection(layout=config.layout, strategy=config.strategy, backend=config.backend,
                                           window_size=config.window_size))
        self.layout, self.strategy, self.backend = options.layout, options.strategy, options.backend
        self.window_size = options.window_size
        self.group = None

    def bind(self, group, layout: Optional[Layout] = None) -> None:
        """Run over `group` (the cp group, or a one-rank group without CP)."""
        self.group = group
        if layout is not None:
            self.layout = layout

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if self.group is None:
            raise RuntimeError("DtcpAttention has no group: build the model through dtcp_model_spec's parallelize_fn "
                               "(DtcpTrainer does)")
        if kwargs.get("score_mod") is not None or kwargs.get("out_transform") is not None:
            raise NotImplementedError("DtcpAttention takes no score_mod / out_transform (flex-only hooks)")
        if attention_masks is not None and not isinstance(attention_masks, DtcpDocuments):
            raise TypeError(f"DtcpAttention takes DtcpDocuments or None as attention_masks, got "
                            f"{type(attention_masks).__name__}: run it under DtcpTrainer")
        layout = self.layout
        if attention_masks is not None and attention_masks.layout is not None:
            layout = attention_masks.layout
        if isinstance(layout, Auto):  # no documents this batch: what the trainer sharded with
            layout = layout.resolve(None)
        out = dtcp.ring_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2), self.group,
            layout=layout, is_causal=True, scale=scale, enable_gqa=q_BLNH.shape[2] != k_BLNH.shape[2],
            backend=self.backend, strategy=self.strategy, window_size=self.window_size,
            cu_seqlens=None if attention_masks is None else attention_masks.cu_seqlens,
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        cp = None if self.group is None else group_size(self.group)
        return (f"layout={self.layout.spec()}, strategy={self.strategy}, backend={self.backend}, "
                f"window_size={self.window_size}, cp={cp}")


# ---- the model spec --------------------------------------------------------------------------
_INNER = (FlexAttention.Config, VarlenAttention.Config, DtcpAttention.Config)


def _swap_attention(model_config, options: DtcpOptions) -> int:
    """Replace every inner attention config of `model_config` by a DtcpAttention.Config."""
    w = -1 if options.window_size is None else options.window_size[0]
    n = 0
    for fqn, cfg, parent, attr in list(model_config.traverse(_INNER)):
        if parent is None:
            raise ValueError(f"dtcp: the model config itself is an attention config ({type(cfg).__name__})")
        new = DtcpAttention.Config(layout=options.layout.spec(), strategy=options.strategy, backend=options.backend,
                                   window_size=w)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
        n += 1
    return n


def _check_only_dtcp(attention_modules, cp_mesh) -> None:
    """Stands in for torchtitan's apply_cp_to_forward (spmd_backend "partial_dtensor")."""
    others = sorted({type(m).__name__ for m in attention_modules if not isinstance(m, DtcpAttention)})
    if others:
        raise RuntimeError(f"dtcp did not replace these attention modules: {others}")


def _dtcp_parallelize(base_parallelize):
    def parallelize(model, *, parallel_dims, **kwargs):
        modules = [m for m in model.modules() if isinstance(m, DtcpAttention)]
        if not modules:
            raise RuntimeError(f"dtcp found no DtcpAttention in {type(model).__name__}: build the model config with "
                               "dtcp_model_spec")
        if parallel_dims.cp_enabled:
            cp_mesh = parallel_dims.get_mesh("cp")
            group, layout = cp_mesh.get_group(), None
            modules[0].layout.check(kwargs["training"].seq_len, cp_mesh.size())
        else:
            # Without CP the attention still runs through dtcp (documents and windows, which the
            # CPU and 0.3's sdpa lack), on a one-rank group of this process: whole sequences in
            # order, whatever the layout (contiguous has no divisibility rule).
            group, layout = dist.new_group([dist.get_rank()], use_local_synchronization=True), dtcp.Contiguous()
        for m in modules:
            m.bind(group, layout)
        logger.info(f"dtcp: {len(modules)} attention modules over cp={group_size(group)} ({modules[0].extra_repr()})")
        if parallel_dims.cp_enabled and kwargs["parallelism"].spmd_backend == "partial_dtensor":
            with _patches.replaced_global(base_parallelize, "apply_cp_to_forward", _check_only_dtcp, "0.3.0"):
                return base_parallelize(model, parallel_dims=parallel_dims, **kwargs)
        return base_parallelize(model, parallel_dims=parallel_dims, **kwargs)

    parallelize.__name__ = f"dtcp_{base_parallelize.__name__}"
    parallelize.__qualname__ = parallelize.__name__
    parallelize.dtcp_base = base_parallelize
    return parallelize


def dtcp_model_spec(spec: ModelSpec, options: DtcpOptions) -> ModelSpec:
    """`spec` with dtcp's attention in every layer and its parallelize_fn wrapped (a copy: the
    model config is deep-copied; idempotent)."""
    model = copy.deepcopy(spec.model)
    if _swap_attention(model, options) == 0:
        raise ValueError(f"dtcp found no FlexAttention/VarlenAttention config in {spec.name} {spec.flavor}")
    fn = getattr(spec.parallelize_fn, "dtcp_base", spec.parallelize_fn)
    return dataclasses.replace(spec, model=model, parallelize_fn=_dtcp_parallelize(fn))


def layer_flops_per_token(model: torch.nn.Module) -> Optional[float]:
    """6 x the matmul parameters a token passes through in the model's first transformer block
    (``model.layers``): its 2-D weights, and of weights stacked over experts (3-D, torchtitan's
    GroupedExperts) the share of the ``top_k`` experts a token is routed to (a module's ``top_k``
    in the block, else 1). What dtcp's "step" cost objective weighs each attention call's host
    time against (dtcp.config.layer_flops_per_token). None without ``layers``."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if hasattr(layers, "values") else layers or ())
    if not blocks:
        return None
    top_k = next((m.top_k for m in blocks[0].modules() if isinstance(getattr(m, "top_k", None), int)), 1)
    params = 0
    for p in blocks[0].parameters():
        if p.dim() == 2:
            params += p.numel()
        elif p.dim() == 3:  # (experts, ...): the experts a token goes through
            params += p.numel() // p.shape[0] * top_k
    return 6.0 * params if params else None


def attention_heads(model: torch.nn.Module) -> Optional[tuple[int, int, int]]:
    """(query heads, key/value heads, head dim) of the model's first attention module (one with
    int ``n_heads`` and ``head_dim``, ``n_kv_heads`` defaulting to ``n_heads``: torchtitan's
    GQAttention): what `layout="auto"` places a packed batch for (dtcp.config.attention_heads).
    None where no module has them."""
    for module in model.modules():
        heads, head_dim = getattr(module, "n_heads", None), getattr(module, "head_dim", None)
        if isinstance(heads, int) and isinstance(head_dim, int) and heads > 0 and head_dim > 0:
            kv_heads = getattr(module, "n_kv_heads", None) or heads
            if isinstance(kv_heads, int) and heads % kv_heads == 0:
                return heads, kv_heads, head_dim
    return None


# ---- the trainer -----------------------------------------------------------------------------
class DtcpTrainer(Trainer):
    """torchtitan's Trainer with dtcp as its context parallelism (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dtcp: DtcpSection = field(default_factory=DtcpSection)

    def __init__(self, config: Config):
        self.dtcp_options = options = dtcp_options(config.dtcp)
        if config.parallelism.spmd_backend == "full_dtensor":
            raise ValueError("dtcp runs with --parallelism.spmd_backend spmd_types (the default) or partial_dtensor; "
                             "full_dtensor hands the attention DTensors")
        if config.model_spec is None:
            raise ValueError("DtcpTrainer.Config needs a model_spec (e.g. llama3's model_registry('debugmodel'))")
        config.model_spec = dtcp_model_spec(config.model_spec, options)
        super().__init__(config)
        self.dtcp_layer_flops = layer_flops_per_token(self.model_parts[0])
        self.dtcp_attention_heads = attention_heads(self.model_parts[0])
        if self.dtcp_layer_flops and dtcp.config.layer_flops_per_token is None:
            logger.info(f"dtcp: layer_flops_per_token {self.dtcp_layer_flops:.4g} (the model's transformer block), "
                        f"for the cost objective {dtcp.config.cost_objective!r}")

    def forward_backward_step(self, **kwargs):
        """torchtitan's, with dtcp.config.layer_flops_per_token the model's (unless the user set it):
        the default cost objective ("auto") then ranks each attention call as part of this step."""
        with dtcp.config.layer_work(self.dtcp_layer_flops, self.dtcp_attention_heads):
            return super().forward_backward_step(**kwargs)

    def post_dataloading_process(self, input_dict, labels):
        """Document boundaries from the whole batch's positions, then inputs, labels and positions
        sharded with dtcp's layout over the cp group. Returns (inputs, labels, extra_kwargs)."""
        options = self.dtcp_options
        inputs = input_dict["input"]
        extra: dict[str, Any] = {k: v for k, v in input_dict.items() if k != "input"}
        B, S = inputs.shape
        positions = extra.get("positions")
        if positions is None or not options.documents:
            positions = torch.arange(S, device=inputs.device, dtype=torch.int64).expand(B, S)
        cu = document_boundaries(positions) if options.documents else None
        layout, chosen = options.layout, None
        if isinstance(layout, Auto) and self.parallel_dims.cp_enabled:
            # Balanced for one packed row of documents, else zigzag (rows of their own documents)
            # (with the ring steps whose host time the rest of the layer hides: the cost objective's)
            cp = self.parallel_dims.get_mesh("cp").size()
            with dtcp.config.layer_work(self.dtcp_layer_flops, self.dtcp_attention_heads):
                layout = resolve_auto(layout, cu, S, cp, B, options.strategy)
            chosen = options.layout.by_boundaries(layout) if isinstance(layout, Balanced) else layout
            said = layout.op_spec() if isinstance(layout, Balanced) else layout.name  # (with its hidden steps)
            if getattr(self, "_dtcp_last_choice", None) != said:  # say so when the choice changes
                self._dtcp_last_choice = said
                logger.info(f"dtcp: layout auto -> {said} ({B} row(s) of {S} tokens, "
                            f"{len(cu) - 1 if cu is not None else 0} documents)")
        if options.documents:
            extra["attention_masks"] = DtcpDocuments(cu, chosen)
        if self.parallel_dims.cp_enabled:
            cp_mesh = self.parallel_dims.get_mesh("cp")
            group = cp_mesh.get_group()
            inputs, labels, positions = (layout.shard(t, group, dim=1).contiguous()
                                         for t in (inputs, labels, positions))
        extra["positions"] = positions
        # as torchtitan: after sharding, so that it counts the tokens this rank processes
        self.ntokens_seen += labels.numel()
        if self.config.parallelism.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, extra = annotate_input_spmd_types(self.parallel_dims, inputs, labels, extra)
        return inputs, labels, extra


def dtcp_config(config: Trainer.Config, **options) -> DtcpTrainer.Config:
    """A stock ``Trainer.Config`` as a `DtcpTrainer.Config` (same fields), with `options` (the
    fields of `DtcpSection`) as its dtcp section. Validates them at once."""
    section = DtcpSection(**options)
    dtcp_options(section)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.pop("dtcp", None)
    return DtcpTrainer.Config(**values, dtcp=section)
