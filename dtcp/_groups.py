"""Accept a ProcessGroup, a 1-D DeviceMesh, a group name or None wherever dtcp takes a group.

Foundation module: imports nothing from dtcp but `_compat`. Per-group *state* (transport,
agreement, failure) lives in `dtcp.comm.groups`.
"""

from __future__ import annotations

from typing import Union

import torch.distributed as dist

from . import _compat

GroupLike = Union["dist.ProcessGroup", "dist.device_mesh.DeviceMesh", str, None]


def resolve_group(group: GroupLike) -> "dist.ProcessGroup":
    """ProcessGroup for `group`: None means the default group; a DeviceMesh must be 1-D."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dtcp needs torch.distributed initialised: call dist.init_process_group(...) "
            "(or launch with torchrun) before using a context-parallel group"
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        return _compat.group_from_name(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    mesh_cls = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh passed as a process group must be 1-D here; got a "
                f"{group.ndim}-D mesh with dims {group.mesh_dim_names}. Pass mesh['cp'] instead (ring_attention "
                "takes a 2-D CP mesh, ring dim then Ulysses dim, with strategy='hybrid')."
            )
        return group.get_group()
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None; got {type(group).__name__}")


def resolve_cp_groups(group) -> tuple["dist.ProcessGroup", "dist.ProcessGroup | None"]:
    """(sequence group, head group) of a context-parallel `group`. A 1-D group (ProcessGroup, 1-D
    DeviceMesh, name, None) gives (it, None). A 2-D DeviceMesh (ring dim, Ulysses dim) or a pair
    (ring group, Ulysses group) gives both: CP rank = ring rank * U + Ulysses rank, so the Ulysses
    dim is the inner (fastest varying) one, as in torch's DeviceMesh with ranks laid out row-major."""
    mesh_cls = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_cls is not None and isinstance(group, mesh_cls) and group.ndim == 2:
        return group.get_group(0), group.get_group(1)
    if isinstance(group, (tuple, list)):
        if len(group) != 2:
            raise ValueError(f"group: a 2-D context-parallel group is a pair (ring_group, ulysses_group); got "
                             f"{len(group)} items")
        ring, heads = resolve_group(group[0]), resolve_group(group[1])
        return ring, heads
    if mesh_cls is not None and isinstance(group, mesh_cls) and group.ndim > 2:
        raise ValueError(f"group: a context-parallel DeviceMesh has 1 or 2 dims (ring, ulysses); got {group.ndim} "
                         f"dims {group.mesh_dim_names}. Slice it: mesh['cp_ring', 'cp_ulysses']")
    return resolve_group(group), None


def cp_size_and_rank(group) -> tuple[int, int]:
    """(N, CP rank) of a 1-D or 2-D context-parallel group (resolve_cp_groups)."""
    return cp_size_and_rank_of(*resolve_cp_groups(group))


def cp_size_and_rank_of(ring: "dist.ProcessGroup", heads: "dist.ProcessGroup | None") -> tuple[int, int]:
    """(N, CP rank) of resolved groups: CP rank = ring rank * U + Ulysses rank."""
    if heads is None:
        return group_size(ring), group_rank(ring)
    return group_size(ring) * group_size(heads), group_rank(ring) * group_size(heads) + group_rank(heads)


def group_name(group: GroupLike) -> str:
    return _compat.name_of_group(resolve_group(group))


def group_size(pg: "dist.ProcessGroup") -> int:
    return dist.get_world_size(pg)


def group_rank(pg: "dist.ProcessGroup") -> int:
    return dist.get_rank(pg)


def global_rank(pg: "dist.ProcessGroup", rank_in_group: int) -> int:
    return dist.get_global_rank(pg, rank_in_group)
