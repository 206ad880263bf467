"""dtcp's state for each process group: the guard, dtcp's own communicator, the transports.

Keyed weakly by the ProcessGroup *object*: a group that is destroyed and created again (even
under the same name) is a new object and gets fresh state, and state dies with its group. Custom
ops carry groups by name; `state_of(_compat.group_from_name(name))` resolves the name to the
group registered now.

dtcp never communicates on the caller's group itself. Its first call on a group makes a group of
its own over the same ranks (members only), with `dtcp.config.timeout_s` as its timeout and, on
NCCL, a high-priority stream. So every wait for a peer is bounded by the backend itself (gloo
raises; NCCL's watchdog aborts), a failure never leaves the caller's group in a bad state, and
dtcp can abort its communicator when a rank fails.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import _compat
from ..config import config
from . import watchdog
from .cuda_driver import driver
from .guard import GroupGuard


class GroupState:
    """Everything dtcp keeps for one process group."""

    def __init__(self, pg: "dist.ProcessGroup"):
        self.name = _compat.name_of_group(pg)
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
        self.backend = dist.get_backend(pg)
        self._pg = weakref.ref(pg)
        self.guard = GroupGuard(pg)
        self._comm_group: Optional["dist.ProcessGroup"] = None
        self.rings: dict = {}  # torch.device -> RingComm
        self.copy_engines: dict = {}  # device index -> CopyEngineRing or None (agreed: NCCL)
        self.health: dict = {}  # device index -> int32 scalar, 1 until the group fails (CUDA only)
        self._release_streams: dict = {}
        self.guard.on_fail(self._abort_communication)

    def registered(self) -> bool:
        """Whether the caller's group is still the one registered under its name (not destroyed)."""
        return _registered(self._pg, self.name)

    @property
    def pg(self) -> "dist.ProcessGroup":
        pg = self._pg()
        if pg is None:  # the state is dropped with its group; a watchdog pass may still hold it
            raise RuntimeError(f"dtcp: process group {self.name!r} no longer exists")
        return pg

    def comm_group(self) -> "dist.ProcessGroup":
        """dtcp's own group over the same ranks (see the module docstring). Made on first use,
        by every member at the same call (after an agreement), so its creation cannot hang."""
        if self._comm_group is None:
            high_priority = self.backend == "nccl" and config.high_priority_ring
            name = f"dtcp:{self.name}:{self.guard.generation}"
            self._comm_group = _compat.new_group_like(self.pg, name, config.timeout_s, high_priority)
            _OWN_GROUPS.append((self._pg, self.name, self._comm_group))
        return self._comm_group

    def assert_healthy(self, device: torch.device) -> None:
        """Enqueue, on the current stream, the check that stops this rank's GPU work if the group
        failed while it was blocked (dtcp/comm/watchdog.py). Called at the end of every dtcp call
        on CUDA; the first one makes the health word and puts the group under the watchdog."""
        word = self.health.get(device.index)
        if word is None:
            word = self.health[device.index] = torch.ones((), dtype=torch.int32, device=device)
            self._release_streams[device.index] = torch.cuda.Stream(device=device)
            watchdog.watch(self)
        _compat.assert_async(word, "dtcp: this rank's dtcp call could not finish because the process group failed "
                                   "(see the 'dtcp:' error logged above)")

    def _abort_communication(self) -> None:
        """Runs once when the group fails (any thread): clear the health words first, then let
        blocked GPU waits go on, then abort dtcp's communicator."""
        for index, word in self.health.items():
            stream = self._release_streams[index].cuda_stream
            with torch.cuda.device(index):
                driver().write(stream, word.data_ptr(), 0)
                ring = self.copy_engines.get(index)
                if ring is not None:
                    ring.release(stream)
        if self._comm_group is not None:
            _compat.abort_group(self._comm_group)  # NCCL: pending operations end; gloo: its timeout bounds them


_STATES: "weakref.WeakKeyDictionary[dist.ProcessGroup, GroupState]" = weakref.WeakKeyDictionary()
# dtcp's own groups: (weak reference to the caller's group, its name, dtcp's group)
_OWN_GROUPS: list = []
# every GroupState made, weakly: a state whose group is gone drops out of _STATES but may live on in
# a cycle (its routes hold it) until the cyclic collector runs; the exit release reaches it here
_EVERY_STATE: "weakref.WeakSet[GroupState]" = weakref.WeakSet()


def state_of(pg: "dist.ProcessGroup") -> GroupState:
    state = _STATES.get(pg)
    if state is None:
        _release_groups_of_gone_parents()
        state = _STATES[pg] = GroupState(pg)
        _EVERY_STATE.add(state)
    return state


def _release_groups_of_gone_parents() -> None:
    """Destroy dtcp's groups whose caller's group was destroyed (or collected): a loop that makes
    groups again and again must not keep a communicator per group it ever made."""
    keep = []
    for parent_ref, name, own in _OWN_GROUPS:
        if _registered(parent_ref, name):
            keep.append((parent_ref, name, own))
        else:
            _compat.destroy_group(own)
    _OWN_GROUPS[:] = keep


def _registered(pg_ref, name: str) -> bool:
    """Whether the group behind the weak reference `pg_ref` is alive and registered as `name`."""
    pg = pg_ref()
    if pg is None:
        return False
    try:
        return _compat.group_from_name(name) is pg
    except Exception:  # noqa: BLE001 - not registered any more (destroyed)
        return False


def release_at_exit() -> None:
    """Let go of every dtcp group whose caller's group was destroyed, before the interpreter
    finalizes: destroy it if torch still has it, drop the states' references to it (their ring
    transports and routes) and collect the cycles that may still hold it. Its backend is then
    torn down while Python still runs. Left to finalization, a gloo backend can abort the process
    ("terminate called without an active exception", SIGABRT after a clean run): one of its
    worker threads releasing a tensor needs the GIL, which a finalizing interpreter never gives
    back. Groups whose caller's group is still alive are left as they are (torch owns their
    teardown; destroying a communicator here could wait on a peer). Runs at exit, after the
    watchdog stops; tests call it by hand."""
    _release_groups_of_gone_parents()
    for state in list(_EVERY_STATE):
        if not state.registered():
            state._comm_group = None
            state.rings.clear()
            getattr(state, "routes", {}).clear()
    gc.collect()


@atexit.register
def _at_exit() -> None:
    watchdog.stop_at_exit()  # (its thread reads the states released next)
    release_at_exit()


def all_states() -> list[GroupState]:
    return list(_STATES.values())


def on_device_of(t: torch.Tensor):
    """The transports' streams and driver calls act on the current CUDA device: make it t's."""
    if t.device.type == "cuda" and torch.cuda.current_device() != t.device.index:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
