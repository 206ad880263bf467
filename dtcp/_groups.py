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
                f"group: a DeviceMesh passed as the context-parallel group must be 1-D; got a "
                f"{group.ndim}-D mesh with dims {group.mesh_dim_names}. Pass mesh['cp'] instead."
            )
        return group.get_group()
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None; got {type(group).__name__}")


def group_name(group: GroupLike) -> str:
    return _compat.name_of_group(resolve_group(group))


def group_size(pg: "dist.ProcessGroup") -> int:
    return dist.get_world_size(pg)


def group_rank(pg: "dist.ProcessGroup") -> int:
    return dist.get_rank(pg)


def global_rank(pg: "dist.ProcessGroup", rank_in_group: int) -> int:
    return dist.get_global_rank(pg, rank_in_group)
