"""Layouts applied to tensors of a process group: shard, unshard, and DocZigzag's packing.

Uses torch.distributed directly (rank, size, one all-gather), not dtcp's comm stage: sharding
inputs is a step before the pipeline, and it works on any group, CPU or GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._groups import GroupLike, cp_size_and_rank, group_rank, group_size, resolve_cp_groups, resolve_group

# Index tensors already on a device, keyed by value (layout, length, ranks, device): a copy from
# pageable host memory to a GPU waits for the GPU's queued work, and `shard` runs every step.
_DEVICE_POSITIONS: dict = {}


def positions_on(layout, seq_len: int, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
    """layout.global_positions on `device`, copied there once (read only: never hand it out)."""
    key = (layout, seq_len, world_size, rank, device)
    idx = _DEVICE_POSITIONS.get(key)
    if idx is None:
        if len(_DEVICE_POSITIONS) >= 256:
            _DEVICE_POSITIONS.clear()
        idx = _DEVICE_POSITIONS[key] = layout.global_positions(seq_len, world_size, rank).to(device)
    return idx


def shard(layout, x: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
    """This rank's piece of the full tensor `x` along `dim` (`group` 1-D, or a 2-D CP mesh)."""
    n, r = cp_size_and_rank(group)
    dim = dim % x.dim()
    layout.check(x.shape[dim], n)
    runs = layout.runs(x.shape[dim], n, r)
    if len(runs) == 1:
        return x.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
    return x.index_select(dim, positions_on(layout, x.shape[dim], n, r, x.device))


def unshard(layout, x_local: torch.Tensor, group: GroupLike = None, dim: int = 2) -> torch.Tensor:
    """The full tensor in original token order (all-gather; gradients flow back to the shards)."""
    ring_pg, head_pg = resolve_cp_groups(group)
    n = cp_size_and_rank(group)[0]
    dim = dim % x_local.dim()
    if head_pg is None:
        gathered = _AllGatherCat.apply(x_local, ring_pg, dim)  # rank-major order
    else:  # a 2-D CP mesh: inside the Ulysses groups, then across them: CP-rank-major order
        gathered = _AllGatherCat.apply(_AllGatherCat.apply(x_local, head_pg, dim), ring_pg, dim)
    inv = torch.argsort(layout.permutation(x_local.shape[dim] * n, n))
    return gathered.index_select(dim, inv.to(x_local.device))


class _AllGatherCat(torch.autograd.Function):
    """Concatenate every rank's tensor along `dim` (rank-major). Backward: sum the incoming
    gradients over ranks (all-reduce) and keep this rank's slice. Works on gloo and NCCL."""

    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(group_size(pg))]
        dist.all_gather(parts, x, group=pg)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # gloo needs contiguous buffers
        dist.all_reduce(grad, group=ctx.pg)
        n, r = group_size(ctx.pg), group_rank(ctx.pg)
        m = grad.shape[ctx.dim] // n
        return grad.narrow(ctx.dim, r * m, m).contiguous(), None, None


# ---- DocZigzag: packed <-> padded -------------------------------------------------------------
def pad_documents(layout, x: torch.Tensor, world_size: int, dim: int = 0) -> torch.Tensor:
    """Packed (..., T, ...) -> padded (..., S_padded, ...), zeros in the padding."""
    dim = dim % x.dim()
    if x.shape[dim] != sum(layout.doc_lens):
        raise ValueError(f"pad: dim {dim} has {x.shape[dim]} tokens; the documents hold {sum(layout.doc_lens)}")
    shape = list(x.shape)
    shape[dim] = layout.padded_len(world_size)
    return x.new_zeros(shape).index_copy(dim, layout.real_positions(world_size).to(x.device), x)


def shard_packed(layout, x: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
    pg = resolve_group(group)
    return shard(layout, pad_documents(layout, x, group_size(pg), dim), pg, dim)


def loss_mask(layout, group: GroupLike = None) -> torch.Tensor:
    pg = resolve_group(group)
    n = group_size(pg)
    real = torch.zeros(layout.padded_len(n), dtype=torch.bool)
    real[layout.real_positions(n)] = True
    return real[layout.global_positions(layout.padded_len(n), n, group_rank(pg))]


def unshard_packed(layout, x_local: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
    pg = resolve_group(group)
    full = unshard(layout, x_local, pg, dim)
    return full.index_select(dim % full.dim(), layout.real_positions(group_size(pg)).to(full.device))
