"""Copy-engine ring transport for CUDA: zero SMs, zero CPU waits, and no hang when a rank fails.

Why: NCCL's point-to-point transfers run as CUDA kernels. cuDNN's Hopper attention kernels are
persistent (one CTA per SM for the whole kernel), so an NCCL kernel launched next to one gets no
SM until the attention kernel ends, and the "overlapped" transfer runs after the compute. The
copy engines need no SM (measurements: docs/performance.md).

How: each rank owns receive slots in symmetric memory, so every rank can address its neighbours'
slots. A transfer is a cuMemcpyAsync into the neighbour's slot on a side stream (a copy engine
over NVLink), followed by a 32-bit flag write into the neighbour's memory (cuStreamWriteValue32).
The receiver's compute stream waits on that flag (cuStreamWaitValue32). Before overwriting a slot
the sender waits for the receiver's "slot free" flag, which the receiver writes when it hands the
slot out again. Flags carry increasing sequence numbers, so nothing is ever reset. As in NCCL's own
zero-SM path, the flag write is ordered after the copy on the same stream.

Slots: two for K/V and two for float32 dK/dV, in two separate symmetric regions, each sized before
its first exchange for the largest buffer it carries (`ensure`, a collective made at the same call
on every rank: K/V when a ring route is built, dK/dV when its first backward starts). Growing one
region never moves the other's slots. Symmetric memory per rank: 2 x (K + V bytes) + 2 x (float32
dK + dV bytes) of the largest local block, i.e. 24 bytes per local token per K/V head and head-dim
element for bf16 K/V (8 for the K/V slots, 16 for the dK/dV slots).

Failure: the GPU waits above have no time limit of their own. dtcp's watchdog thread
(dtcp/comm/watchdog.py) queries, every 0.1 s, the two events that bracket each wait (never a copy
from the GPU, which could queue behind the stuck stream). When a wait the host enqueued has not been satisfied for `dtcp.config.timeout_s`, or
another rank posted an abort record, the group fails (dtcp/comm/groups.py): its health word is
cleared and the ring *released*: every local flag is written far ahead, so every waiting stream goes
on, and the assertion each dtcp call enqueues at its end stops this rank's stream before any result
is used. Every later dtcp call on the group raises GroupFailedError.
"""

from __future__ import annotations

import contextlib
import math
import logging
import threading
import time
from typing import Optional

import torch

from .. import _compat
from ..config import config
from ..errors import PeerFailedError
from .cuda_driver import driver

log = logging.getLogger("dtcp")

_RELEASE_AHEAD = 1 << 30  # released flags read as "arrived" for the next 2^30 exchanges


# Slots 0, 1: K/V; 2, 3: dK/dV. Flags (int32) per rank: [direction][kind][slot], kind 0 = "full"
# (written by the sender), 1 = "free" (written by the receiver); direction 0: data moves to rank+1.
_NUM_SLOTS = 4
_FLAGS = 2 * 2 * _NUM_SLOTS
_FIRST_SLOT = {"kv": 0, "grad": 2}


def _flag_index(direction: int, kind: int, slot: int) -> int:
    return (direction * 2 + kind) * _NUM_SLOTS + slot


class _Region:
    """One symmetric allocation holding two slots of `slot_bytes`, and its peers' addresses."""

    def __init__(self, ring: "CopyEngineRing", slot_bytes: int):
        self.ring, self.slot_bytes = ring, slot_bytes
        self.tensor = _compat.symm_mem_empty(2 * slot_bytes, torch.uint8, ring.device)  # local: may fail alone
        self.base: dict[int, int] = {}

    def connect(self) -> None:
        """Exchange handles with the peers (collective)."""
        ring = self.ring
        self._handle = _compat.symm_mem_rendezvous(self.tensor, ring.name)  # keeps the peers' mappings alive
        self.base = {r: (self.tensor if r == ring.rank else
                         self._handle.get_buffer(r, (2 * self.slot_bytes,), torch.uint8)).data_ptr()
                     for r in range(ring.world)}


class CopyEngineRing:
    """Symmetric slots and flags for one process group on one device; reused by every ring call.
    Made by `copy_engine_ring` after the group agreed on it."""

    def __init__(self, state, device: torch.device):
        self.state, self.guard = state, state.guard
        self.device, self.device_index = device, device.index
        self.rank, self.world, self.name = state.rank, state.size, state.name
        self.driver = driver()
        self.flags = _compat.symm_mem_empty(_FLAGS, torch.int32, device)
        self.flags.zero_()
        self._flag_base: dict[int, int] = {}
        self.regions: dict[str, Optional[_Region]] = {"kv": None, "grad": None}
        self.seq = [[0] * _NUM_SLOTS for _ in range(2)]  # per direction, per slot
        # one side stream per (direction, K/V or dK/dV), so a dK/dV send never delays a K/V one
        self.streams = [[torch.cuda.Stream(device=device) for _ in range(2)] for _ in range(2)]
        self.stream_handles = [[s.cuda_stream for s in pair] for pair in self.streams]
        self.events_in = [[self.driver.new_event() for _ in range(2)] for _ in range(2)]
        self.events_out = [[self.driver.new_event() for _ in range(2)] for _ in range(2)]
        # Tensors sent since the last drain: kept alive until the copies reading them are ordered
        # before the compute stream (drain), so the caching allocator cannot hand their memory to
        # new compute-stream work while a copy engine still reads it.
        self._in_flight: list[torch.Tensor] = []
        self.waits = WaitTracker(self.driver)  # every GPU wait, for the watchdog
        self._lock = threading.Lock()
        self.released = False
        torch.cuda.synchronize(device)

    def connect(self) -> None:
        """Exchange the flags' handles with the peers (collective; after every rank built its ring)."""
        self._flag_handle = _compat.symm_mem_rendezvous(self.flags, self.name)
        self._flag_base = {r: (self.flags.data_ptr() if r == self.rank else
                               self._flag_handle.get_buffer(r, (_FLAGS,), torch.int32).data_ptr())
                           for r in range(self.world)}
        torch.cuda.synchronize(self.device)

    # ---- slots -----------------------------------------------------------------------------------
    def ensure(self, kind: str, slot_bytes: int) -> None:
        """Make the `kind` region hold two slots of at least `slot_bytes`. Collective: every rank
        calls it at the same point of the same call (route build, first backward), with the same
        size (the route's shapes are agreed)."""
        region = self.regions[kind]
        if region is not None and region.slot_bytes >= slot_bytes:
            return
        torch.cuda.synchronize(self.device)  # nothing of ours still reads or writes the old region
        self.regions[kind] = None
        new, why = None, None
        try:
            new = _Region(self, slot_bytes)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory on this rank only
            why = f"{type(e).__name__}: {e}"
        votes = self.guard.exchange_posts(f"copy-engine {kind} slots of {slot_bytes} bytes", {"why": why})
        refusals = [(r, v["why"]) for r, v in enumerate(votes) if v["why"] is not None]
        if refusals:
            raise PeerFailedError(f"dtcp: rank {refusals[0][0]} could not allocate copy-engine {kind} slots of "
                                  f"{slot_bytes} bytes: {refusals[0][1]}")
        new.connect()
        self.regions[kind] = new

    def buffers(self, like: list[torch.Tensor], kind: str, dtype=None) -> list[list[torch.Tensor]]:
        """Two receive buffers shaped like `like` (a list of tensors; in `dtype` if given) in the
        `kind` region."""
        region = self.regions[kind]
        specs = [(t.shape, dtype or t.dtype) for t in like]
        need = sum(_aligned(math.prod(shape) * dt.itemsize) for shape, dt in specs)
        if region is None or region.slot_bytes < need:
            raise RuntimeError(f"dtcp: copy-engine {kind} slots hold {0 if region is None else region.slot_bytes} bytes, "
                               f"this exchange needs {need}: the route did not size them (a dtcp bug)")
        # Views are cheap; not cached (their shapes change with every document structure).
        return [self._views(region, specs, i) for i in range(2)]

    def fit(self, slot: list[torch.Tensor], shapes: list[tuple], kind: str) -> list[torch.Tensor]:
        """Views of the slot that `slot` (from `buffers`) lies in, shaped `shapes` and packed as
        `exchange` packs what it sends: each tensor at the next 256-byte boundary after the last."""
        region = self.regions[kind]
        index = self._slot_of(slot, kind) - _FIRST_SLOT[kind]
        views = self._views(region, [(shape, t.dtype) for t, shape in zip(slot, shapes)], index)
        for v, t in zip(views, slot):
            if v.numel() > t.numel():
                raise RuntimeError(f"dtcp: a receive of shape {tuple(v.shape)} does not fit its slot {tuple(t.shape)} (a dtcp bug)")
        return views

    @staticmethod
    def _views(region: _Region, shapes_dtypes, slot: int) -> list[torch.Tensor]:
        views, offset = [], slot * region.slot_bytes
        for shape, dtype in shapes_dtypes:
            n = math.prod(shape) * dtype.itemsize
            views.append(region.tensor[offset:offset + n].view(dtype).view(shape))
            offset += _aligned(n)
        return views

    def _slot_of(self, tensors, kind: str) -> int:
        region = self.regions[kind]
        off = tensors[0].data_ptr() - region.tensor.data_ptr() if region is not None else -1
        if region is None or not (0 <= off < 2 * region.slot_bytes) or off % region.slot_bytes:
            raise RuntimeError(f"dtcp: a copy-engine exchange must receive into its {kind} slots (a dtcp bug)")
        return _FIRST_SLOT[kind] + off // region.slot_bytes

    def _flag_addr(self, rank: int, index: int) -> int:
        return self._flag_base[rank] + 4 * index

    # ---- exchange ----------------------------------------------------------------------------------
    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int, kind: str, index: int) -> tuple:
        """Send `send` into the slot of rank+shift that corresponds to our `recv` slot (`index`: 0
        or 1 of our `kind` slots; `recv` may be empty), and receive into `recv` from rank-shift.
        Returns what `wait` needs."""
        slot = _FIRST_SLOT[kind] + index
        if any(t.numel() for t in recv) and self._slot_of(recv, kind) != slot:
            raise RuntimeError(f"dtcp: a copy-engine exchange must receive into {kind} slot {index} (a dtcp bug)")
        region = self.regions[kind]
        direction = 0 if shift == 1 else 1
        nxt, prv = (self.rank + shift) % self.world, (self.rank - shift) % self.world
        self.seq[direction][slot] += 1
        seq = self.seq[direction][slot]
        d = self.driver
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        pair = slot // 2
        side = self.stream_handles[direction][pair]
        # sources are ready, and our previous uses of `recv` are enqueued, before the side stream goes on
        d.order(side, self.events_in[direction][pair], compute)
        # 1. our recv slot is free again (everything that read it is enqueued before this point)
        d.write(side, self._flag_addr(prv, _flag_index(direction, 1, slot)), seq)
        # 2. wait until the next rank has freed its slot, copy into it, then flag it full
        free_flag = _flag_index(direction, 1, slot)
        with self.waits.tracked(side, f"rank {nxt} to free its {kind} slot"):
            d.wait(side, self._flag_addr(self.rank, free_flag), seq)
        dst = region.base[nxt] + (slot - _FIRST_SLOT[kind]) * region.slot_bytes
        for src in send:
            n = src.numel() * src.element_size()
            if n:
                d.copy(dst, src.data_ptr(), n, side)  # a copy engine over NVLink
            self._in_flight.append(src)
            dst += _aligned(n)
        d.write(side, self._flag_addr(nxt, _flag_index(direction, 0, slot)), seq)
        return (direction, slot, seq, prv, kind)

    def wait(self, pending: tuple) -> None:
        """Make the current stream wait until the data of this exchange has arrived (our own
        outgoing copy is waited for by `drain`)."""
        direction, slot, seq, prv, kind = pending
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        full_flag = _flag_index(direction, 0, slot)
        with self.waits.tracked(compute, f"{kind} data from rank {prv}"):
            self.driver.wait(compute, self._flag_addr(self.rank, full_flag), seq)

    def drain(self) -> None:
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        for direction in range(2):
            for pair in range(2):
                self.driver.order(compute, self.events_out[direction][pair], self.stream_handles[direction][pair])
        self._in_flight.clear()

    # ---- failure -----------------------------------------------------------------------------------
    def release(self, stream: int) -> None:
        """Let every waiting stream of this rank go on: write every local flag far ahead, on
        `stream` (after the group's health word was cleared there). Idempotent."""
        with self._lock:
            if self.released:
                return
            self.released = True
        ahead = max(max(s) for s in self.seq) + _RELEASE_AHEAD
        for i in range(_FLAGS):
            self.driver.write(stream, self.flags.data_ptr() + 4 * i, ahead)

    def stalled(self) -> Optional[str]:
        """A watchdog pass (see WaitTracker.stalled): the wait this rank's GPU has sat in for
        longer than dtcp.config.timeout_s, described, else None."""
        if self.released:
            return None
        with torch.cuda.device(self.device_index):  # the driver's event queries need its context current
            what = self.waits.stalled(config.timeout_s)
        if what is None:
            return None
        return (f"rank {self.rank} of process group {self.name!r} waited {config.timeout_s:g} s "
                f"(dtcp.config.timeout_s) for {what} on the copy-engine ring")


class WaitTracker:
    """The GPU waits of one ring, for the watchdog: each is bracketed by an event recorded just
    before it and one just after, on the waiting stream. The watchdog only queries events: reading
    the flags would be a device-to-host copy, which can queue behind the very stream that is stuck.
    Events are recycled once both are done. `driver` needs new_event, record and done."""

    def __init__(self, driver):
        self.driver = driver
        self.pending: list[list] = []  # [event before, event after, time first seen reached or None, what]
        self._free: list = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def tracked(self, stream, what: str):
        """Bracket the wait enqueued inside the block on `stream`."""
        with self._lock:
            events = [self._free.pop() if self._free else None for _ in range(2)]
        before, after = (e if e is not None else self.driver.new_event() for e in events)
        self.driver.record(before, stream)
        yield
        self.driver.record(after, stream)
        with self._lock:
            self.pending.append([before, after, None, what])

    def stalled(self, timeout_s: float, now: Optional[float] = None) -> Optional[str]:
        """Drop the waits the GPU has passed; return what a wait it has sat in for longer than
        `timeout_s` waits for, else None. Time counts from when a pass first saw the GPU reach the
        wait, not from when the host enqueued it: the host may run a whole step ahead."""
        now = time.monotonic() if now is None else now
        with self._lock:
            pending = list(self.pending)
        passed, stalled = [], None
        for entry in pending:
            before, after, reached_at, what = entry
            if self.driver.done(after):
                passed.append(entry)
                continue
            if reached_at is None and self.driver.done(before):
                entry[2] = reached_at = now
            if reached_at is not None and now - reached_at > timeout_s and stalled is None:
                stalled = what
        with self._lock:
            gone = {id(e) for e in passed}
            self.pending = [e for e in self.pending if id(e) not in gone]
            self._free.extend(ev for e in passed for ev in e[:2])
        return stalled


def _aligned(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


# ---- construction, agreed by every rank --------------------------------------------------------
def copy_engine_ring(state, device: torch.device) -> Optional[CopyEngineRing]:
    """The copy-engine ring of `state`'s group on `device`, or None where the group uses another
    transport (CPU tensors, one rank, NCCL). Every rank takes the same path: the ranks vote on what
    each can do locally, build the ring (symmetric-memory rendezvous), and vote again on the result."""
    if device.type != "cuda" or state.size == 1:
        return None
    if device.index in state.copy_engines:
        return state.copy_engines[device.index]
    why = None
    if config.transport == "nccl":
        why = "dtcp.config.transport='nccl'"
    else:
        try:
            driver()
            _compat.symm_mem_available()
        except Exception as e:  # noqa: BLE001 - no libcuda stream memory ops, no symmetric memory module, ...
            why = f"{type(e).__name__}: {e}"
    ring = None
    if why is None:
        try:
            ring = CopyEngineRing(state, device)  # local allocations only
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
    votes = state.guard.exchange_posts("copy-engine transport", {"why": why})
    if all(v["why"] is None for v in votes):
        try:
            ring.connect()
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        votes = state.guard.exchange_posts("copy-engine transport connected", {"why": why})
    refusals = [(r, v["why"]) for r, v in enumerate(votes) if v["why"] is not None]
    if refusals:
        ring = None
        if config.transport == "ce":
            raise PeerFailedError(f"dtcp.config.transport='ce' but the copy-engine ring cannot run: rank "
                                  f"{refusals[0][0]}: {refusals[0][1]}")
        if config.transport == "auto":
            log.warning("dtcp: copy-engine ring unavailable (rank %d: %s); using NCCL", *refusals[0])
    state.copy_engines[device.index] = ring
    return ring
