"""DTensor support: layouts as placements, and DTensor q/k/v inside `context_parallel`.

Design (the same on torch 2.11 through 2.13, the versions checked). A DTensor whose sequence
dim is split by a dtcp layout L over mesh dim m is an ordinary DTensor with the standard
placement `Shard(dim)` on m whose *global* tensor is the sequence permuted by L: gathering the
ranks' shards in rank order gives ``x[L.permutation(S, N)]``, and every rank's standard shard is
exactly its L-shard. dtcp keeps the layout in a side table (weakly keyed by the DTensor object)
so that `dtcp.full_tensor` / `dtcp.redistribute` can undo the permutation.

Why not a placement class of our own: a subclass of `Shard` is silently turned into a contiguous
`Shard` by `distribute_tensor`, and redistribution plans are cached by placement equality, so
results depend on what was cached first; a direct `Placement` subclass is rejected by DTensor's
sharding propagation. Standard placements over the permuted sequence give DTensor nothing new
to understand, so every DTensor op and redistribution works unchanged, and position-wise ops
(linear layers, norms, elementwise) are correct on the permuted sequence as they are on shards.

The side table follows the object, not the data: a DTensor computed from a layout DTensor
(``y = x * 2``) carries no record. `dtcp.full_tensor(y)` then raises and asks for
``placements=[..., dtcp.Zigzag(dim=1)]`` rather than return tokens in permuted order.

Inside `dtcp.context_parallel(layout=L)`, a DTensor q/k/v sharded on the sequence dim (2) over
the context-parallel mesh dim is taken to be in the block's layout L (as PyTorch's own context
parallel takes its load-balanced order): that is what `dtcp.distribute_tensor(x, mesh, [...,
L(dim=1)])` followed by ordinary DTensor ops produces.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

try:  # public home since torch 2.5
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
    from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None

from torch.utils.weak import WeakTensorKeyDictionary

from .._groups import group_size
from ..layouts import Layout, layout_from_spec

# DTensor -> the placements it was made with, layouts included (see the module docstring).
_LAYOUT_PLACEMENTS = WeakTensorKeyDictionary()


def is_dtensor(x) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


# ---- placements ------------------------------------------------------------------------------


def _lower(placements: Sequence, mesh, ndim: int, shape=None, what: str = "placements"):
    """Standard placements for `placements` (layouts become Shard(dim)) and the permutations
    they stand for: a list of (tensor dim, layout, mesh dim)."""
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{what} needs one placement per mesh dim ({mesh.ndim}); got {len(placements)}")
    std, perms = [], []
    for m, p in enumerate(placements):
        if isinstance(p, Layout):
            if p.dim is None:
                raise ValueError(
                    f"{what}[{m}]={p!r} as a placement needs the tensor dim it splits, e.g. {type(p).__name__}(dim=1)"
                )
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what}[{m}]={p!r}: dim {p.dim} is not a dim of a {ndim}-D tensor")
            d = p.dim % ndim
            perms.append((d, p, m))
            std.append(Shard(d))
        elif isinstance(p, Placement):
            if p.is_shard():
                p = Shard(p.dim % ndim)
            std.append(p)
        else:
            raise TypeError(f"{what}[{m}] must be a DTensor Placement or a dtcp Layout; got {type(p).__name__}")
    for d, layout, m in perms:
        others = [i for i, p in enumerate(std) if p.is_shard() and p.dim == d and i != m]
        if others:
            raise ValueError(
                f"{what}: tensor dim {d} is split by {layout!r} on mesh dim {m} and also sharded on mesh dims "
                f"{others}; a layout must be the only split of its tensor dim"
            )
        if shape is not None:
            n = mesh.size(m)
            mult = layout.multiple(n)
            if shape[d] <= 0 or shape[d] % mult:
                raise ValueError(
                    f"{what}[{m}]={layout!r} over {n} ranks needs size along dim {d} to be a positive multiple of "
                    f"{mult}; got {shape[d]}. Pad it to a multiple of {mult}."
                )
    return std, perms


def _perm(layout: Layout, seq_len: int, n: int, device) -> torch.Tensor:
    return layout_from_spec(layout.spec()).permutation(seq_len, n).to(device)


def _record(dt, placements) -> None:
    if not torch.compiler.is_compiling():
        _LAYOUT_PLACEMENTS[dt] = tuple(placements)


def layout_placements(dt) -> Optional[tuple]:
    """The placements (layouts included) `dt` was made with by a dtcp function, or None."""
    return _LAYOUT_PLACEMENTS.get(dt)


def _src_placements(dt, placements, fn: str):
    if placements is not None:
        return list(placements)
    recorded = layout_placements(dt)
    if recorded is None:
        raise ValueError(
            f"dtcp.{fn}: this DTensor carries no dtcp layout record (it was not made by dtcp.distribute_tensor, "
            "dtcp.from_local or dtcp.redistribute, e.g. it is the result of an op on one). Pass placements=[...] "
            "saying how it is split, e.g. [Replicate(), dtcp.Zigzag(dim=1)]; for a plain DTensor use its own methods."
        )
    return list(recorded)


def _check_matches(dt, std, fn: str, given) -> None:
    if tuple(std) != tuple(dt.placements):
        raise ValueError(f"dtcp.{fn}: placements {list(given)} do not match the DTensor's placements {list(dt.placements)}")


# ---- public functions ---------------------------------------------------------------------------


def distribute_tensor(tensor: torch.Tensor, device_mesh, placements: Sequence, *, src_data_rank: Optional[int] = 0):
    """Like `torch.distributed.tensor.distribute_tensor`, and placements may be dtcp layouts with
    `dim` set: ``dtcp.distribute_tensor(x, mesh, [Replicate(), dtcp.Zigzag(dim=1)])``.

    Args:
        tensor: the full tensor (the same on every rank, or taken from `src_data_rank`), e.g.
            hidden states (B, S, D).
        device_mesh: the DeviceMesh.
        placements: one per mesh dim: Replicate(), Shard(d), Partial(), or a layout L(dim=d).

    Returns:
        a DTensor; each rank's local tensor along dim d is its L-shard (S/N tokens, layout order).
    """
    if not isinstance(tensor, torch.Tensor) or is_dtensor(tensor):
        raise TypeError("dtcp.distribute_tensor takes a full (non-DTensor) torch.Tensor")
    std, perms = _lower(placements, device_mesh, tensor.dim(), tensor.shape)
    x = tensor
    for d, layout, m in perms:
        x = x.index_select(d, _perm(layout, x.shape[d], device_mesh.size(m), x.device))
    kwargs = {} if src_data_rank == 0 else {"src_data_rank": src_data_rank}
    dt = _torch_distribute_tensor(x.detach(), device_mesh, std, **kwargs)
    if tensor.requires_grad:
        dt.requires_grad_(True)
    _record(dt, placements)
    return dt


def from_local(local: torch.Tensor, device_mesh, placements: Sequence, *, run_check: bool = False):
    """`DTensor.from_local` where placements may be layouts with `dim` set: wraps this rank's
    layout shard (e.g. a buffer sharded by `context_parallel`). Differentiable."""
    std, _ = _lower(placements, device_mesh, local.dim())
    dt = DTensor.from_local(local, device_mesh, std, run_check=run_check)
    _record(dt, placements)
    return dt


def full_tensor(dt, placements: Optional[Sequence] = None) -> torch.Tensor:
    """The full tensor in original token order. `placements` (layouts included) says how `dt` is
    split; by default the ones it was made with by a dtcp function. Differentiable."""
    if not is_dtensor(dt):
        raise TypeError(f"dtcp.full_tensor takes a DTensor; got {type(dt).__name__}")
    given = _src_placements(dt, placements, "full_tensor")
    std, perms = _lower(given, dt.device_mesh, dt.dim(), dt.shape)
    _check_matches(dt, std, "full_tensor", given)
    full = dt.full_tensor()
    for d, layout, m in perms:
        inv = torch.argsort(_perm(layout, full.shape[d], dt.device_mesh.size(m), full.device))
        full = full.index_select(d, inv)
    return full


def redistribute(dt, placements: Sequence, *, src_placements: Optional[Sequence] = None):
    """`DTensor.redistribute` where source and target placements may be layouts: the result
    holds the same tokens, split as `placements` say. Redistributing to all-Replicate gives the
    original token order. Differentiable."""
    if not is_dtensor(dt):
        raise TypeError(f"dtcp.redistribute takes a DTensor; got {type(dt).__name__}")
    mesh = dt.device_mesh
    given = _src_placements(dt, src_placements, "redistribute")
    src_std, src_perms = _lower(given, mesh, dt.dim(), dt.shape, "src_placements")
    _check_matches(dt, src_std, "redistribute", given)
    dst_std, dst_perms = _lower(placements, mesh, dt.dim(), dt.shape)

    # The global tensor of dt is the original permuted by the source layouts. Along a dim whose
    # permutation changes, gather that dim (make it Replicate), reorder it locally, then split
    # it again the new way. A permutation depends only on the layout and the mesh dim's size.
    def key(perms, d):
        return next(((lay.spec(), mesh.size(m)) for dd, lay, m in perms if dd == d), None)

    changed = [d for d in range(dt.dim()) if key(src_perms, d) != key(dst_perms, d)]
    x = dt
    if changed:
        mid = [Replicate() if (p.is_shard() and p.dim in changed) else p for p in src_std]
        x = x.redistribute(mesh, mid)
        local = x.to_local()
        for d in changed:
            n = dt.shape[d]
            src = next(((lay, m) for dd, lay, m in src_perms if dd == d), None)
            dst = next(((lay, m) for dd, lay, m in dst_perms if dd == d), None)
            ident = torch.arange(n, device=local.device)
            p_src = _perm(src[0], n, mesh.size(src[1]), local.device) if src else ident
            p_dst = _perm(dst[0], n, mesh.size(dst[1]), local.device) if dst else ident
            # current[i] = original[p_src[i]]; wanted[j] = original[p_dst[j]] = current[inv_src[p_dst[j]]]
            local = local.index_select(d, torch.argsort(p_src)[p_dst])
        x = DTensor.from_local(local, mesh, mid, run_check=False)
    out = x.redistribute(mesh, dst_std)
    _record(out, placements)
    return out


# ---- SDPA on DTensors inside context_parallel --------------------------------------------------


def ring_sdpa_dtensor(mode, q, k, v, is_causal, scale, enable_gqa):
    """Ring attention for DTensor q (B, Hq, S, D), k/v (B, Hkv, S, D) inside `context_parallel`.

    Placements allowed on each mesh dim: Replicate, Shard(0) (batch), Shard(1) (heads), and on at
    most one mesh dim Shard(2) (sequence), which runs the ring over that mesh dim's group; without
    one, the local sequence is taken to be the block's shard and the ring runs over the block's
    group. Returns a DTensor with q's mesh and placements.
    """
    if not (is_dtensor(q) and is_dtensor(k) and is_dtensor(v)):
        raise TypeError("scaled_dot_product_attention inside dtcp.context_parallel: q, k and v must be all "
                        "DTensors or all plain tensors; convert with DTensor.from_local / .to_local()")
    mesh = q.device_mesh
    if k.device_mesh != mesh or v.device_mesh != mesh:
        raise ValueError("q, k and v DTensors must live on the same DeviceMesh")
    if not (tuple(q.placements) == tuple(k.placements) == tuple(v.placements)):
        raise ValueError(f"q, k and v DTensors must have the same placements; got q {q.placements}, "
                         f"k {k.placements}, v {v.placements}. Redistribute them to one placement first.")
    seq_mesh_dims = []
    for m, p in enumerate(q.placements):
        if p.is_replicate():
            continue
        if p.is_shard() and p.dim % 4 in (0, 1):
            continue
        if p.is_shard() and p.dim % 4 == 2:
            seq_mesh_dims.append(m)
            continue
        raise ValueError(
            f"scaled_dot_product_attention inside dtcp.context_parallel: placement {p} on mesh dim {m} is not "
            "supported for q/k/v; use Replicate, Shard(0) (batch), Shard(1) (heads) or Shard(2) (sequence) "
            "and redistribute first (e.g. reduce a Partial)."
        )
    if len(seq_mesh_dims) > 1:
        raise ValueError(f"q/k/v are sharded on the sequence over mesh dims {seq_mesh_dims}; shard it over one "
                         "(the context-parallel dim)")
    group = mode.group
    if isinstance(group, tuple):
        raise ValueError("scaled_dot_product_attention inside dtcp.context_parallel on a 2-D CP mesh got DTensor "
                         "q/k/v: pass plain local tensors (the block shards the buffers), or use a 1-D CP mesh")
    if seq_mesh_dims:
        m = seq_mesh_dims[0]
        group = mesh.get_group(m)
        if mesh.size(m) != group_size(mode.group):
            raise ValueError(
                f"q/k/v are sharded on the sequence over mesh dim {m} of size {mesh.size(m)}, but the "
                f"context_parallel block's group has {group_size(mode.group)} ranks; use the block's cp mesh dim"
            )
        if not torch.compiler.is_compiling():
            recorded = layout_placements(q)
            if recorded is not None and isinstance(recorded[m], Layout) and recorded[m].spec() != mode.layout.spec():
                raise ValueError(f"q is split by {recorded[m]!r} but the context_parallel block uses "
                                 f"{mode.layout!r}; use the same layout for both")
    out = mode.ring(q.to_local(), k.to_local(), v.to_local(), group, is_causal, scale, enable_gqa)
    return DTensor.from_local(out, mesh, q.placements, run_check=False)

