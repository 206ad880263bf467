"""`with dtcp.context_parallel(mesh, ...)`: run unchanged model code with context parallelism.

Inside the block:
  * the listed buffers (input ids, labels, position ids, ...) hold this rank's shard of the
    sequence, in the block's layout, and get their full values back on exit;
  * every call of `torch.nn.functional.scaled_dot_product_attention` runs `dtcp.ring_attention`
    over the local shards.

How the SDPA calls are caught: a `torch.overrides.TorchFunctionMode`. PyTorch's own
`context_parallel` swaps the attribute `F.scaled_dot_product_attention`, so a name bound before
the block (`from torch.nn.functional import scaled_dot_product_attention`) keeps the original and
silently computes local-only attention. A torch-function mode sees the call however it was named
(both names are the same builtin, `torch._C._nn.scaled_dot_product_attention`, and that builtin
consults the mode stack). torch.compile traces through an active mode: a model compiled outside
the block and called inside it compiles once, with the ring op in the graph and no graph break;
entering the block every step with the same arguments does not recompile (checked on torch 2.13:
dynamo guards on the mode stack's types and on the mode's attributes, which are equal from one
step to the next; tests/test_context.py counts frames and graph breaks).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from .. import _compat
from .._groups import cp_size_and_rank
from ..api import resolve_auto, ring_attention
from ..layouts import DEFAULT_LAYOUT, Auto, Balanced, Layout, layout_from_spec
from . import dtensor as _dt

_SDPA_FUNCS = _compat.sdpa_functions()

# ---- mesh / group --------------------------------------------------------------------------


def resolve_cp_mesh(mesh, mesh_dim=None):
    """(cp DeviceMesh, its CP group) from a 1-D mesh, or an N-D mesh plus `mesh_dim`. `mesh_dim`
    may name two dims, (ring dim, Ulysses dim): the CP group is then the pair of their groups (a
    2-D CP mesh, for strategy="hybrid"; CP rank = ring rank * U + Ulysses rank)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh (init_device_mesh(...)); got {type(mesh).__name__}"
        )
    if isinstance(mesh_dim, (tuple, list)):
        if len(mesh_dim) != 2 or mesh.mesh_dim_names is None or not all(d in mesh.mesh_dim_names for d in mesh_dim):
            raise ValueError(f"mesh_dim={tuple(mesh_dim)!r}: a 2-D CP mesh is named by two of this mesh's dims "
                             f"{mesh.mesh_dim_names}, (ring dim, Ulysses dim)")
        sub = mesh[tuple(mesh_dim)]
        return sub, (sub.get_group(0), sub.get_group(1))
    if mesh.ndim == 1:
        if mesh_dim is not None and mesh_dim not in (0, mesh.mesh_dim_names and mesh.mesh_dim_names[0]):
            raise ValueError(f"mesh_dim={mesh_dim!r} does not name the only dim of this 1-D mesh {mesh.mesh_dim_names}")
        return mesh, mesh.get_group()
    if mesh_dim is None:
        raise ValueError(
            f"mesh is {mesh.ndim}-D with dims {mesh.mesh_dim_names}: pass mesh_dim= naming the "
            "context-parallel dim (e.g. mesh_dim='cp'), or pass the 1-D mesh['cp']"
        )
    if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
        if not 0 <= mesh_dim < mesh.ndim:
            raise ValueError(f"mesh_dim={mesh_dim} is out of range for a {mesh.ndim}-D mesh")
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("mesh_dim as an int needs a mesh with mesh_dim_names (init_device_mesh(..., mesh_dim_names=...))")
        mesh_dim = names[mesh_dim]
    if mesh.mesh_dim_names is None or mesh_dim not in mesh.mesh_dim_names:
        raise ValueError(f"mesh_dim={mesh_dim!r} is not one of this mesh's dims {mesh.mesh_dim_names}")
    sub = mesh[mesh_dim]
    return sub, sub.get_group()


# ---- buffers ---------------------------------------------------------------------------------


def _check_buffers(buffers, seq_dims, what: str = "buffer_seq_dims") -> tuple[list, list]:
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if seq_dims is None else list(seq_dims)
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"{what} must give one sequence dim per buffer: got {len(buffers)} buffers and {len(seq_dims)} dims"
        )
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers[{i}] must be a torch.Tensor; got {type(b).__name__}")
        if not isinstance(d, int) or isinstance(d, bool) or not -b.dim() <= d < b.dim():
            raise ValueError(f"{what}[{i}]={d!r} is not a dim of buffers[{i}] (shape {tuple(b.shape)})")
    for i, b in enumerate(buffers):
        if any(b is c for c in buffers[:i]):
            raise ValueError(f"buffers[{i}] appears twice in buffers; list each tensor once")
    return buffers, [d % b.dim() for b, d in zip(buffers, seq_dims)]


def shard_buffers(mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                  layout: Union[Layout, str] = DEFAULT_LAYOUT, *, mesh_dim=None) -> list[torch.Tensor]:
    """This rank's shard of each full buffer, split along its seq dim in `layout` order.

    Args:
        mesh: 1-D context-parallel DeviceMesh, or an N-D mesh with `mesh_dim`.
        buffers: full tensors, the same on every rank (e.g. input ids (B, S), labels (B, S)).
        seq_dims: the sequence dim of each buffer.
        layout: dtcp layout; S must be a multiple of ``layout.multiple(N)``.

    Returns:
        New tensors (not views), each with S/N along its seq dim; differentiable.
    """
    _, pg = resolve_cp_mesh(mesh, mesh_dim)
    layout = layout_from_spec(layout)
    buffers, seq_dims = _check_buffers(buffers, seq_dims, "seq_dims")
    n = cp_size_and_rank(pg)[0]
    out = []
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        _check_len(layout, b.shape[d], n, f"buffers[{i}] (shape {tuple(b.shape)}, seq dim {d})")
        out.append(layout.shard(b, pg, d).clone(memory_format=torch.contiguous_format))
    return out


def unshard_buffers(mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                    layout: Union[Layout, str] = DEFAULT_LAYOUT, *, mesh_dim=None) -> list[torch.Tensor]:
    """Inverse of `shard_buffers`: all-gather each local shard (S/N along its seq dim) back to the
    full tensor in original token order. Differentiable (gradients flow back to the shards)."""
    _, pg = resolve_cp_mesh(mesh, mesh_dim)
    layout = layout_from_spec(layout)
    buffers, seq_dims = _check_buffers(buffers, seq_dims, "seq_dims")
    n = cp_size_and_rank(pg)[0]
    out = []
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        _check_len(layout, b.shape[d] * n, n, f"buffers[{i}] (local shape {tuple(b.shape)}, seq dim {d})")
        out.append(layout.unshard(b, pg, d))
    return out


@torch.no_grad()
def context_parallel_unshard(mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *,
                             layout: Union[Layout, str] = DEFAULT_LAYOUT, mesh_dim=None) -> list[torch.Tensor]:
    """Same meaning as `torch.distributed.tensor.experimental.context_parallel_unshard`: the full
    tensors (original token order) of shards produced inside a `context_parallel` block with this
    `layout` (e.g. the model's output logits). No gradient, like PyTorch's."""
    return unshard_buffers(mesh, buffers, seq_dims, layout, mesh_dim=mesh_dim)


def _documents_layout(layout: Layout, ring_kwargs: dict, seq_len: Optional[int], world_size: int,
                      batch: int, two_dims: bool = False) -> tuple[Layout, dict]:
    """layout="auto": Balanced for the documents of ``cu_seqlens`` (shared by every row of
    `seq_len` tokens), with the ring steps the cost objective in force hides
    (`dtcp.hidden_ring_steps`), else Zigzag (dtcp/layouts/auto.py). A Balanced layout carries its
    documents: ``cu_seqlens`` given beside it must be the same boundaries, and the calls then
    take them from the layout."""
    cu = ring_kwargs.get("cu_seqlens")
    if isinstance(layout, Auto):
        # (a 2-D mesh runs hybrid, which the placement choice does not predict: the ring's placement)
        strategy = "hybrid" if two_dims else ring_kwargs.get("strategy", "auto")
        layout = resolve_auto(layout, cu, seq_len, world_size, batch, strategy)
    if isinstance(layout, Balanced) and layout.doc_lens is None:  # "balanced": the placement of cu_seqlens
        if cu is None:
            raise ValueError("layout='balanced' (dtcp.Balanced()) places the documents of cu_seqlens: pass "
                             "cu_seqlens=..., or layout=dtcp.Balanced(doc_lens), or layout='auto'")
        layout = Balanced.from_cu_seqlens(cu, min_chunk=layout.min_chunk, hidden_steps=layout.hidden_steps)
    if isinstance(layout, Balanced) and cu is not None:
        values = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
        if [int(c) for c in values] != layout.cu_seqlens.tolist():
            raise ValueError(f"cu_seqlens {values} are not the documents of {layout!r}: a Balanced layout places its "
                             "own documents; pass layout='auto' with these cu_seqlens, or the Balanced layout alone")
        ring_kwargs = {k: v for k, v in ring_kwargs.items() if k != "cu_seqlens"}
    return layout, ring_kwargs


def _check_len(layout: Layout, seq_len: int, n: int, what: str) -> None:
    m = layout.multiple(n)
    if seq_len <= 0 or seq_len % m != 0:
        raise ValueError(
            f"{what}: {layout!r} over {n} ranks needs a sequence length that is a positive multiple "
            f"of {m}; got {seq_len}. Pad the sequence to a multiple of {m}."
        )


# ---- the SDPA rewrite ----------------------------------------------------------------------------


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class RingSDPAMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `dtcp.ring_attention`; every other torch
    function passes through unchanged.

    Args:
        group: the context-parallel ProcessGroup.
        layout: the layout of the local shards that reach SDPA.
        backend: forwarded to ring_attention.
        ring_kwargs: further keyword options forwarded to ring_attention as they are.
    """

    def __init__(self, group, layout: Layout, backend: str = "auto", ring_kwargs: Optional[dict] = None):
        super().__init__()
        self.group = group
        self.layout = layout
        self.backend = backend
        self.ring_kwargs = dict(ring_kwargs or {})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA_FUNCS:
            return func(*args, **kwargs)
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
        if attn_mask is not None:
            raise ValueError(
                "scaled_dot_product_attention inside dtcp.context_parallel got attn_mask; an explicit mask "
                "over local shards cannot describe attention across ranks. Pass attn_mask=None and "
                "is_causal=True for causal attention, or call attention outside the block."
            )
        if dropout_p != 0.0:
            raise ValueError(
                f"scaled_dot_product_attention inside dtcp.context_parallel got dropout_p={dropout_p}; dtcp's "
                "ring attention is exact and has no attention dropout. Pass dropout_p=0.0 (e.g. set the "
                "model's attention dropout to 0 or call model.eval()), or apply dropout to the attention output."
            )
        if _dt.is_dtensor(q) or _dt.is_dtensor(k) or _dt.is_dtensor(v):
            return _dt.ring_sdpa_dtensor(self, q, k, v, is_causal, scale, enable_gqa)
        return self.ring(q, k, v, self.group, is_causal, scale, enable_gqa)

    def ring(self, q, k, v, group, is_causal, scale, enable_gqa):
        return ring_attention(
            q, k, v, group, layout=self.layout, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, backend=self.backend, **self.ring_kwargs,
        )


class ContextParallelHandle:
    """What `with dtcp.context_parallel(...) as cp:` binds: the block's mesh, group and layout."""

    def __init__(self, mesh, group, layout: Layout):
        self.mesh, self.group, self.layout = mesh, group, layout

    @property
    def world_size(self) -> int:
        return cp_size_and_rank(self.group)[0]

    @property
    def rank(self) -> int:
        """This rank's place in the CP group (ring rank * U + Ulysses rank on a 2-D CP mesh)."""
        return cp_size_and_rank(self.group)[1]

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions (int64, (seq_len / N,)) of this rank's tokens of a sequence of
        `seq_len` tokens: feed them to RoPE."""
        return self.layout.positions(seq_len, self.group)


# One mode object per configuration, reused from step to step: dynamo guards on the mode and its
# attributes, and a fresh but equal object each step would be one more thing to get wrong. Bounded
# (least recently used first out), and never keyed by a tensor: options that hold tensors (e.g.
# cu_seqlens, new every batch) get a fresh mode each time instead of one cached entry per tensor.
_MODES: "OrderedDict[tuple, RingSDPAMode]" = OrderedDict()
_MAX_MODES = 16


def _mode_for(pg, layout: Layout, backend: str, ring_kwargs: dict) -> RingSDPAMode:
    if any(isinstance(value, torch.Tensor) for value in ring_kwargs.values()):
        return RingSDPAMode(pg, layout, backend, ring_kwargs)
    try:
        key = (pg, layout, backend, tuple(sorted(ring_kwargs.items())))
        hash(key)
    except TypeError:  # unhashable ring kwargs: no reuse
        return RingSDPAMode(pg, layout, backend, ring_kwargs)
    mode = _MODES.get(key)
    if mode is None:
        mode = _MODES[key] = RingSDPAMode(pg, layout, backend, ring_kwargs)
        if len(_MODES) > _MAX_MODES:
            _MODES.popitem(last=False)
    else:
        _MODES.move_to_end(key)
    return mode


@contextlib.contextmanager
def context_parallel(
    mesh,
    buffers: Optional[Sequence[torch.Tensor]] = None,
    buffer_seq_dims: Optional[Sequence[int]] = None,
    no_restore_buffers: Optional[set] = None,
    *,
    mesh_dim: Union[str, int, None] = None,
    layout: Union[Layout, str] = DEFAULT_LAYOUT,
    backend: str = "auto",
    **ring_kwargs: Any,
) -> Iterator[ContextParallelHandle]:
    """Context parallelism for unchanged model code; a drop-in for
    `torch.distributed.tensor.experimental.context_parallel` (same keyword names).

    Args:
        mesh: a 1-D DeviceMesh over the context-parallel ranks, or an N-D mesh with `mesh_dim`.
        buffers: full tensors to shard in place along their sequence dims for the block, e.g.
            input ids (B, S), labels (B, S), position ids (B, S). Inside the block each holds
            (..., S/N, ...) in `layout` order; on exit it holds its full value again, unless it
            is in `no_restore_buffers`. A buffer may require grad (or be set to inside): the
            shard is swapped in through `.data`, and a gradient accumulated inside the block is
            all-gathered into the full-shape gradient on exit.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers (a subset of `buffers`) that keep their shard after the block.
        mesh_dim: name (or index) of the context-parallel dim when `mesh` is N-D, e.g. "cp"; or
            two names, (ring dim, Ulysses dim), for a 2-D CP mesh (strategy "hybrid", which
            "auto" takes there), e.g. ("cp_ring", "cp_ulysses").
        layout: which tokens each rank holds (dtcp.Zigzag(), dtcp.Contiguous(), dtcp.Striped(b)),
            or "auto": dtcp.Balanced for the documents of ``cu_seqlens`` (equal tokens and equal
            causal work per rank on any document mix), else Zigzag; ``cp.layout`` says which.
        backend: local attention kernel, as in `dtcp.ring_attention`.
        **ring_kwargs: further options forwarded to every `dtcp.ring_attention` call unchanged.

    Yields:
        a ContextParallelHandle (mesh, group, layout, positions(seq_len)).

    Inside the block `F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...,
    enable_gqa=...)` with q (B, Hq, S/N, D), k/v (B, Hkv, S/N, D) returns this rank's rows of exact
    attention over the whole sequence; attn_mask and dropout_p > 0 raise ValueError.
    """
    _, pg = resolve_cp_mesh(mesh, mesh_dim)
    layout = layout_from_spec(layout)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'auto'; got {type(backend).__name__}")
    buffers, seq_dims = _check_buffers(buffers, buffer_seq_dims)
    n = cp_size_and_rank(pg)[0]
    seq_len = buffers[0].shape[seq_dims[0]] if buffers else None
    rows = buffers[0].shape[0] if buffers and seq_dims[0] > 0 else 1  # (B, S, ...) buffers: B rows
    layout, ring_kwargs = _documents_layout(layout, ring_kwargs, seq_len, n, rows,
                                            two_dims=isinstance(mesh_dim, (tuple, list)))
    no_restore = list(no_restore_buffers or ())
    for b in no_restore:
        if not any(b is c for c in buffers):
            raise ValueError("no_restore_buffers must be a subset of buffers (the same tensor objects)")
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        _check_len(layout, b.shape[d], n, f"buffers[{i}] (shape {tuple(b.shape)}, buffer_seq_dims[{i}]={d})")

    # Swap each buffer's contents through `.data`, not resize_/copy_: `.data` works whether or not
    # the tensor requires grad (resize_ refuses then) and leaves the full values untouched in
    # `originals`, so restoring needs no clone and in-place edits inside the block cannot leak out.
    originals = []
    with torch.no_grad():
        for b, d in zip(buffers, seq_dims):
            originals.append(b.data)
            b.data = layout.shard(b.data, pg, d).clone(memory_format=torch.contiguous_format)

    mode = _mode_for(pg, layout, backend, ring_kwargs)
    clean_exit = False
    try:
        with mode:
            yield ContextParallelHandle(mesh, pg, layout)
        clean_exit = True
    finally:
        with torch.no_grad():
            for b, d, full in zip(buffers, seq_dims, originals):
                if any(b is c for c in no_restore):
                    continue
                grad = b.grad
                if grad is not None and grad.shape != full.shape:
                    b.grad = None  # a shard-shaped grad cannot stay on the full-shaped tensor
                b.data = full
                if grad is not None and grad.shape != full.shape and clean_exit:
                    # The shard's gradient is d(sum of all ranks' losses)/d(shard), so gathering
                    # the shards' gradients gives the gradient of the full buffer. Only on a clean
                    # exit: after an exception other ranks may not reach this collective.
                    b.grad = layout.unshard(grad, pg, d)

