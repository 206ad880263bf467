"""dtcp as the context parallelism of ``transformers.Trainer`` and TRL's ``SFTTrainer``: one switch.

    import dtcp.integrations.transformers as dtcp_hf

    trainer = dtcp_hf.ContextParallelTrainer(model=model, args=args, train_dataset=ds,
                                             context_parallel=dtcp_hf.ContextParallelConfig(cp_size=2))
    SFTTrainer = dtcp_hf.with_context_parallel(trl.SFTTrainer)      # any Trainer subclass
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=ds, context_parallel=2)

launched as usual (``torchrun`` / ``accelerate launch``) on ``dp * cp_size`` processes. What it does:

* **data**: the data loader is sharded over the ``dp`` groups only, so every rank of a cp group
  loads the same batch (accelerate's own rule for its CP: rank ``r`` is dp rank ``r // cp_size``);
  ``per_device_train_batch_size`` is then per cp group, and the global batch is ``dp`` times it.
* **the step**: forward and backward (so gradient checkpointing's recomputation too) run inside
  `dtcp.integrations.transformers.context_parallel` on the full batch, which shards it: global
  positions, labels shifted before sharding, document boundaries from packing
  (``position_ids`` that restart, ``cu_seq_lens_q``) and from padding (``attention_mask``). A
  sequence length that is not a multiple of ``layout.multiple(cp_size)`` is padded first with an
  isolated run of ``pad_token_id`` tokens whose labels are -100 (nothing changes in the loss).
* **the loss**: ``num_items_in_batch`` is the batch's targets counted once per dp group and summed
  over the dp groups (over the gradient-accumulation window, as Trainer does); each rank's loss is
  then its tokens' share, multiplied by the world size as Trainer does for DDP/FSDP (whose
  gradient reduction averages over every rank): the reduced gradient is the sum of the shares over
  cp, averaged over dp, i.e. the gradient of the global token-mean loss. Logged losses are the
  global loss, as without CP.
* **evaluation**: the same block; ``num_items_in_batch`` counted the same way.
* **the model**: its attention implementation is switched to ``"dtcp"`` (outside a block that is
  HF's eager attention over HF's masks, so ``generate`` and saving are unchanged).

Refused on every rank (the configuration is the same on all of them), with the fix named:
accelerate's own context/sequence parallelism in the same run (``parallelism_config`` with
``cp_size``/``sp_size`` > 1), a world size that ``cp_size`` does not divide, label smoothing and
``compute_loss_func`` (they see shifted, sharded labels), a model whose forward takes no loss
kwargs, MoE router auxiliary losses (a product of means over the sequence: not a sum of shards),
``dispatch_batches=True``, and predictions (logits) from ``evaluate``/``predict`` under CP
(only the loss is supported: the logits are shards).

Trainer / accelerate / TRL internals used here, checked on transformers 5.23.0, accelerate 1.15.0,
trl 1.16.0 (tests/test_trainer.py exercises each):

* ``Trainer.training_step`` / ``prediction_step`` / ``compute_loss`` / ``get_batch_samples`` /
  ``get_cp_size`` are overridden (public "subclass and override" methods). ``compute_loss``
  multiplies the loss by ``accelerator.num_processes`` when ``average_tokens_across_devices`` and
  ``num_items_in_batch`` is given (TRL's ``SFTTrainer.compute_loss`` does the same);
  ``get_cp_size`` divides the dp world size for the batch-size bookkeeping.
* ``Trainer._loss_shifts_labels`` (5.23): whether the count of targets skips each row's first label.
* ``Accelerator.prepare_data_loader`` is replaced on this trainer's accelerator by a call of
  ``accelerate.data_loader.prepare_data_loader`` with ``num_processes=dp`` and
  ``process_index=dp_rank`` and the accelerator's own settings (``split_batches``, ``rng_types``,
  ``even_batches``, ``use_seedable_sampler``, ``dataloader_config.data_seed``, ``non_blocking``,
  ``use_stateful_dataloader``), appended to ``accelerator._dataloaders`` as accelerate does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...layouts import Layout, layout_from_spec
from .block import context_parallel, text_config

logger = logging.getLogger(__name__)

__all__ = ["ContextParallelConfig", "ContextParallelMixin", "ContextParallelTrainer", "with_context_parallel"]

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
    """dtcp's context parallelism for a Trainer.

    Args:
        cp_size: ranks that share one sequence (1: no context parallelism). The world size must be a
            multiple; ``dp = world_size // cp_size``. Ranks ``[d * cp_size, (d + 1) * cp_size)`` form
            cp group ``d`` (consecutive ranks: on one host with ``cp_size`` <= GPUs per host).
        layout: ``"auto"`` (default: per batch, ``dtcp.Balanced`` for one packed row of documents,
            equal tokens and equal causal work per rank on any document mix, else zigzag),
            ``"zigzag"`` (balanced causal work over the whole sequence), ``"contiguous"`` (fewest
            rounds for sliding windows), or a `dtcp.Layout`.
        strategy, backend: as in `dtcp.ring_attention`.
        check_batch: agree on a digest of each batch across the cp ranks (a batch that differs
            between them raises on every rank).
    """

    cp_size: int = 1
    layout: Union[str, Layout] = "auto"
    strategy: str = "auto"
    backend: str = "auto"
    check_batch: bool = True

    def __post_init__(self):
        if not isinstance(self.cp_size, int) or isinstance(self.cp_size, bool) or self.cp_size < 1:
            raise ValueError(f"ContextParallelConfig(cp_size={self.cp_size!r}): cp_size must be an int >= 1")


_MESHES: dict = {}


def _dp_cp_mesh(device_type: str, dp: int, cp: int):
    # Creating groups is collective: every rank builds the same meshes in the same order.
    key = (device_type, dp, cp)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return _MESHES[key]


def _prepare_data_loader_over_dp(accelerator, dp: int, dp_rank: int, data_loader, device_placement=None,
                                 slice_fn_for_dispatch=None):
    """`Accelerator.prepare_data_loader` with the loader sharded over the dp groups only: the cp
    ranks of a dp group iterate the same batches."""
    from accelerate.data_loader import prepare_data_loader

    if getattr(data_loader, "_is_accelerate_prepared", False):
        if data_loader not in accelerator._dataloaders:
            accelerator._dataloaders.append(data_loader)
        return data_loader
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True (accelerate's DataLoaderConfiguration / TrainingArguments.accelerator_config) sends "
            "slices of one process's batch to every process, which cannot give the cp ranks the same batch. Use "
            "dispatch_batches=False with dtcp's context parallelism.")
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=dp, process_index=dp_rank,
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    accelerator._dataloaders.append(prepared)
    return prepared


def pad_to_multiple(batch: dict, multiple: int, pad_token_id: int = 0) -> dict:
    """`batch` with its sequence dim (dim 1 of ``input_ids``) padded at the end to a multiple of
    `multiple`, by a run of `pad_token_id` tokens that no real token attends to and that predicts
    nothing: labels -100; ``position_ids`` restarting at 0 (a document of its own) when the batch
    is packed (has ``position_ids``), else ``attention_mask`` 0 (right padding; made when absent);
    ``cu_seq_lens_q/k`` get the new end. Shapes: ``input_ids`` (B, S) -> (B, S')."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return batch
    bsz, seq = ids.shape
    extra = (-seq) % multiple
    if extra == 0:
        return batch
    out = dict(batch)
    values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "token_type_ids": 0}
    for key, value in values.items():
        t = out.get(key)
        if isinstance(t, torch.Tensor) and t.dim() == 2 and tuple(t.shape) == (bsz, seq):
            out[key] = F.pad(t, (0, extra), value=value)
    pos = out.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[1] == seq:
        tail = torch.arange(extra, device=pos.device, dtype=pos.dtype).expand(pos.shape[0], extra)
        out["position_ids"] = torch.cat([pos, tail], dim=1)
        if "attention_mask" in out and isinstance(out["attention_mask"], torch.Tensor):
            out["attention_mask"] = F.pad(out["attention_mask"], (0, extra), value=0)
    else:
        mask = out.get("attention_mask")
        if mask is None:
            mask = torch.ones(bsz, seq, dtype=torch.long, device=ids.device)
        out["attention_mask"] = F.pad(mask, (0, extra), value=0)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = out.get(key)
        if isinstance(cu, torch.Tensor) and cu.dim() == 1:
            out[key] = torch.cat([cu, cu.new_tensor([seq + extra])])
    out.pop("seq_idx", None)   # TRL's per-token document index: dropped by the block anyway
    return out


def _as_config(value) -> Optional[ContextParallelConfig]:
    if value is None or isinstance(value, ContextParallelConfig):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ContextParallelConfig(cp_size=value)
    if isinstance(value, dict):
        return ContextParallelConfig(**value)
    raise TypeError(f"context_parallel={value!r}: pass a ContextParallelConfig, an int (cp_size) or None")


def _router_aux_loss(model) -> bool:
    text = text_config(model)
    return bool(getattr(text, "output_router_logits", False)) and bool(getattr(text, "router_aux_loss_coef", 0.0))


class ContextParallelMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to train with dtcp's context
    parallelism: ``class MyTrainer(ContextParallelMixin, SFTTrainer)``, then
    ``MyTrainer(..., context_parallel=ContextParallelConfig(cp_size=2))``. With
    ``context_parallel=None`` (or ``cp_size=1``) the trainer is the base class unchanged."""

    def __init__(self, *args, context_parallel: Union[ContextParallelConfig, int, dict, None] = None, **kwargs):
        config = _as_config(context_parallel)
        self.cp_config = config
        self._cp_on = config is not None and config.cp_size > 1
        self._cp_eval_items = None
        if self._cp_on:   # before accelerate builds its own CP from it
            targs = kwargs.get("args", args[1] if len(args) > 1 else None)
            self._cp_refuse_accelerate_cp(getattr(targs, "parallelism_config", None))
        super().__init__(*args, **kwargs)
        if not self._cp_on:
            return
        cp = config.cp_size
        # an accelerate config file / `accelerate launch --parallelism-config-cp-size` reaches only the accelerator
        self._cp_refuse_accelerate_cp(getattr(self.accelerator, "parallelism_config", None))
        world = self.args.world_size
        if world % cp:
            raise ValueError(f"ContextParallelConfig(cp_size={cp}) must divide the world size {world} "
                             f"(launch dp * {cp} processes)")
        if self.args.label_smoothing_factor:
            raise ValueError(
                f"label_smoothing_factor={self.args.label_smoothing_factor} with dtcp's context parallelism: Trainer's "
                "label smoother would shift the already shifted, sharded labels. Use label_smoothing_factor=0.")
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError(
                "compute_loss_func with dtcp's context parallelism: it would receive this rank's shard of the logits "
                "and the labels already shifted (shift_labels). Use the model's own loss (no compute_loss_func).")
        if not getattr(self, "model_accepts_loss_kwargs", False):
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no **kwargs, so it cannot receive num_items_in_batch, "
                "shift_labels and the document boundaries that dtcp's context parallelism passes: each rank's loss "
                "would be a local mean. Use a transformers causal LM (their forwards take **kwargs).")
        if _router_aux_loss(self.model):
            raise ValueError(
                "output_router_logits=True with router_aux_loss_coef != 0: the MoE load-balancing loss is a product of "
                "means over the whole sequence, which the ranks' shards do not sum to. Set "
                "config.output_router_logits=False (SFTConfig(router_aux_loss_coef=0.0) for TRL) under dtcp's context "
                "parallelism.")
        self._cp_size = cp
        self._cp_layout = layout_from_spec(config.layout)
        dp = world // cp
        self._cp_mesh = _dp_cp_mesh(self.args.device.type, dp, cp)
        dp_rank = self._cp_mesh.get_local_rank("dp")
        self.accelerator.prepare_data_loader = functools.partial(
            _prepare_data_loader_over_dp, self.accelerator, dp, dp_rank)
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl != "dtcp":
            logger.info("dtcp: switching %s from attn_implementation=%r to 'dtcp'", type(self.model).__name__, impl)
            self.model.set_attn_implementation("dtcp")

    def _cp_refuse_accelerate_cp(self, pc) -> None:
        for name in ("cp_size", "sp_size"):
            if pc is not None and (getattr(pc, name, 1) or 1) > 1:
                raise ValueError(
                    f"context_parallel=ContextParallelConfig(cp_size={self.cp_config.cp_size}) together with "
                    f"accelerate's parallelism_config {name}={getattr(pc, name)}: use one context parallelism, not "
                    f"both. Drop {name} from TrainingArguments(parallelism_config=...) or the accelerate config "
                    "(dp_shard_size / dp_replicate_size may stay), or drop context_parallel= to use accelerate's.")

    # ---- bookkeeping ----------------------------------------------------------------------------------

    def get_cp_size(self) -> int:
        """cp ranks per dp group (dtcp's times accelerate's, which is refused above 1)."""
        return (self._cp_size if self._cp_on else 1) * super().get_cp_size()

    def _cp_count_items(self, batches: list, device) -> torch.Tensor:
        """Targets of `batches` (HF's rule: ``shift_labels``, else ``labels[..., 1:]`` for causal
        LMs), summed over the dp groups (each counted once) when ``average_tokens_across_devices``,
        and divided by cp as Trainer divides by its cp size: the loss scaling that follows (x world
        size, or none) then makes the reduced gradient that of the token-mean loss."""
        shifts = getattr(self, "_loss_shifts_labels", True)
        total = torch.zeros((), dtype=torch.int64, device=device)
        for b in batches:
            lab = b["shift_labels"] if "shift_labels" in b else (b["labels"][..., 1:] if shifts else b["labels"])
            total = total + lab.ne(IGNORE_INDEX).sum().to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            dist.all_reduce(total)   # every rank of a dp group holds the same batch: cp copies of each
        return total / self._cp_size

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._cp_on and n is not None:
            n = self._cp_count_items(batches, device)
        return batches, n

    # ---- the block --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _cp_block(self, model, inputs, num_items_in_batch):
        base = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        pad_id = getattr(getattr(base, "config", None), "pad_token_id", None) or 0
        batch = pad_to_multiple(dict(inputs), self._cp_layout.multiple(self._cp_size), pad_id)
        if num_items_in_batch is not None:
            batch["num_items_in_batch"] = num_items_in_batch
        c = self.cp_config
        with context_parallel(base, self._cp_mesh, batch, mesh_dim="cp", layout=self._cp_layout, backend=c.backend,
                              strategy=c.strategy, check_batch=c.check_batch) as cp:
            # (a copy: the Trainer may pop keys; the document boundaries reach dtcp's attention
            # through the block's state, not the inputs)
            yield dict(cp.inputs)

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        if not self._cp_on:
            return super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        with self._cp_block(model, inputs, num_items_in_batch) as local:
            # forward and backward inside: gradient checkpointing recomputes attention in the block
            return super().training_step(model, local, num_items_in_batch, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not self._cp_on:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if not prediction_loss_only:
            raise ValueError(
                "evaluate/predict with logits (compute_metrics, prediction_loss_only=False or predict) under dtcp's "
                "context parallelism: each rank holds its shard of the logits only. Evaluate the loss "
                "(prediction_loss_only=True, no compute_metrics), or predict with a trainer without context_parallel.")
        has_labels = any(k in inputs for k in ("labels", "shift_labels"))
        n = self._cp_count_items([inputs], self.args.device) if has_labels else None
        with self._cp_block(model, inputs, n) as local:
            self._cp_eval_items = n
            try:
                return super().prediction_step(model, local, prediction_loss_only, ignore_keys=ignore_keys)
            finally:
                self._cp_eval_items = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._cp_on and self._cp_eval_items is not None:
            # evaluation: the count of the whole batch, not of this rank's shard (Trainer counts the
            # inputs it is given; TRL's SFTTrainer passes none)
            num_items_in_batch = self._cp_eval_items
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


@functools.lru_cache(maxsize=None)
def with_context_parallel(trainer_cls: type) -> type:
    """`trainer_cls` (``transformers.Trainer`` or any subclass, e.g. ``trl.SFTTrainer``) with a
    ``context_parallel=`` argument: ``ContextParallelConfig``, an int (cp_size) or None."""
    if issubclass(trainer_cls, ContextParallelMixin):
        return trainer_cls
    return type(f"ContextParallel{trainer_cls.__name__}", (ContextParallelMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} with dtcp's context parallelism."})


def __getattr__(name: str):
    if name == "ContextParallelTrainer":
        import transformers

        return with_context_parallel(transformers.Trainer)
    if name == "ContextParallelSFTTrainer":
        try:
            import trl
        except ImportError:
            raise ImportError('ContextParallelSFTTrainer needs TRL: pip install "dtcp[trainer]"') from None
        return with_context_parallel(trl.SFTTrainer)
    raise AttributeError(name)
