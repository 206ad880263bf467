"""Copy-engine ring transport for CUDA: zero SMs, zero CPU waits.

Why: NCCL's point-to-point transfers run as CUDA kernels. cuDNN's Hopper attention kernels are
persistent (one CTA per SM for the whole kernel), so an NCCL kernel launched next to one gets no
SM until the attention kernel ends and the "overlapped" transfer runs after the compute (measured
on 4 H200s: only 32-49% of NCCL time concurrent with the forward's attention kernels, with a
high-priority NCCL stream or not). The copy engines need no SM.

How: each rank owns receive slots in symmetric memory (torch.distributed._symmetric_memory), so
every rank can address its neighbours' slots. A transfer is a cudaMemcpyAsync into the neighbour's
slot on a side stream (executed by a copy engine over NVLink), followed by a 32-bit flag write into
the neighbour's memory (cuStreamWriteValue32). The receiver's compute stream waits on that flag
(cuStreamWaitValue32). Before overwriting a slot the sender waits for the receiver's "slot free"
flag, which the receiver writes when it hands the slot out again for the next receive. Flags carry
increasing sequence numbers, so nothing is ever reset. As in NCCL's own zero-SM path, the flag
write is ordered after the copy on the same stream and NVLink delivers them in order.

The transport implements RingComm's interface (`buffers`, `exchange`, `wait`): exchanges whose
receive buffers are its slots and whose peer is the next or previous rank go over the copy
engines; anything else falls back to NCCL.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.distributed as dist

from . import _compat

log = logging.getLogger("dtcp")

_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
_CU_EVENT_DISABLE_TIMING = 0x2


class _Driver:
    """The few CUDA driver calls the transport makes, straight from libcuda (CUDA >= 12 drivers):
    stream memory operations (cuStreamWaitValue32_v2 / cuStreamWriteValue32_v2), which PyTorch
    does not expose, and, for the per-transfer hot path, event record/wait and cuMemcpyAsync
    (a ctypes call costs ~1 us; torch.cuda's Stream/Event/stream-context wrappers cost tens of
    microseconds each, which dominated small ring steps). Streams and pointers are the CUDA
    runtime's own (cudaStream_t is a CUstream; device pointers are unified addresses)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        self.wait32 = self._fn(lib, "cuStreamWaitValue32_v2", [vp, u64, ctypes.c_uint32, ctypes.c_uint])
        self.write32 = self._fn(lib, "cuStreamWriteValue32_v2", [vp, u64, ctypes.c_uint32, ctypes.c_uint])
        self.memcpy = self._fn(lib, "cuMemcpyAsync", [u64, u64, ctypes.c_size_t, vp])
        self.event_create = self._fn(lib, "cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint])
        self.event_record = self._fn(lib, "cuEventRecord", [vp, vp])
        self.stream_wait_event = self._fn(lib, "cuStreamWaitEvent", [vp, vp, ctypes.c_uint])

    @staticmethod
    def _fn(lib, name, argtypes):
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
        return f

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed with CUresult {err}")

    def wait(self, stream: int, addr: int, value: int) -> None:
        self._check(self.wait32(stream, addr, value & 0xFFFFFFFF, _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def write(self, stream: int, addr: int, value: int) -> None:
        self._check(self.write32(stream, addr, value & 0xFFFFFFFF, _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")

    def new_event(self) -> int:
        ev = ctypes.c_void_p()
        self._check(self.event_create(ctypes.byref(ev), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return ev.value

    def order(self, waiter: int, event: int, after: int) -> None:
        """Make stream `waiter` wait for the work enqueued so far on stream `after`."""
        self._check(self.event_record(event, after), "cuEventRecord")
        self._check(self.stream_wait_event(waiter, event, 0), "cuStreamWaitEvent")


# flags (int32) per rank: [direction][kind][slot], kind 0 = "full" (written by the sender),
# 1 = "free" (written by the receiver). direction 0: data moves to rank+1; 1: to rank-1.
_NUM_SLOTS = 4  # two K/V slots and two dK/dV slots
_FLAGS = 2 * 2 * _NUM_SLOTS


def _flag_index(direction: int, kind: int, slot: int) -> int:
    return (direction * 2 + kind) * _NUM_SLOTS + slot


class CopyEngineRing:
    """Symmetric slots and flags for one process group; reused by every ring call."""

    def __init__(self, pg: "dist.ProcessGroup", device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.pg, self.device, self.device_index = pg, device, device.index
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        self.name = _compat.name_of_group(pg)
        _compat.enable_symm_mem(self.name)
        self.symm_mem = symm_mem
        self.driver = _Driver()
        self.flags = symm_mem.empty(_FLAGS, dtype=torch.int32, device=device)
        self.flags.zero_()
        self.flag_handle = symm_mem.rendezvous(self.flags, self.name)
        self.slot_bytes = 0
        self.slots = None
        self._view_cache: dict = {}
        self._remote_slots: dict[int, torch.Tensor] = {}
        self._flag_base = {r: (self.flags.data_ptr() if r == self.rank else
                               self.flag_handle.get_buffer(r, (_FLAGS,), torch.int32).data_ptr())
                           for r in range(self.world)}
        self.seq = [[0] * _NUM_SLOTS for _ in range(2)]  # per direction, per slot
        # one side stream per (direction, K/V or dK/dV), so a dK/dV send never delays a K/V one
        self.streams = [[torch.cuda.Stream(device=device) for _ in range(2)] for _ in range(2)]
        self.stream_handles = [[s.cuda_stream for s in pair] for pair in self.streams]
        # one event per side stream for "side waits for compute" and one for "compute waits for side"
        self.events_in = [[self.driver.new_event() for _ in range(2)] for _ in range(2)]
        self.events_out = [[self.driver.new_event() for _ in range(2)] for _ in range(2)]
        # Tensors sent since the last drain: kept alive until the copies reading them are ordered
        # before the compute stream (drain), so the caching allocator cannot hand their memory
        # to new compute-stream work while a copy engine still reads it.
        self._in_flight: list[torch.Tensor] = []
        torch.cuda.synchronize(device)
        dist.barrier(group=pg)

    def _ensure_slots(self, nbytes: int) -> None:
        if nbytes <= self.slot_bytes:
            return
        # Collective: every rank makes the same calls in the same order.
        torch.cuda.synchronize(self.device)
        self._view_cache.clear()
        self.slots = self.symm_mem.empty(_NUM_SLOTS * nbytes, dtype=torch.uint8, device=self.device)
        self.slot_handle = self.symm_mem.rendezvous(self.slots, self.name)
        self.slot_bytes = nbytes
        self._remote_slots = {r: self.slot_handle.get_buffer(r, (nbytes * _NUM_SLOTS,), torch.uint8)
                              for r in range(self.world) if r != self.rank}
        self._slot_base = {r: (self.slots if r == self.rank else self._remote_slots[r]).data_ptr()
                           for r in range(self.world)}
        dist.barrier(group=self.pg)

    def buffers(self, like: list[torch.Tensor], first_slot: int) -> list[list[torch.Tensor]]:
        """Two receive buffers shaped like `like` (a list of tensors), in slots first_slot and +1."""
        key = (first_slot, tuple((t.shape, t.dtype) for t in like))
        cached = self._view_cache.get(key)
        if cached is not None:
            return cached
        nbytes = sum(_aligned(t.numel() * t.element_size()) for t in like)
        self._ensure_slots(nbytes)
        views = [self._views(like, first_slot + i) for i in range(2)]
        if len(self._view_cache) >= 64:
            self._view_cache.clear()
        self._view_cache[key] = views  # valid until the slots are reallocated (_ensure_slots clears it)
        return views

    def _views(self, like, slot: int) -> list[torch.Tensor]:
        """Tensors shaped like `like`, packed into our own slot `slot` (the layout the senders'
        copies in `exchange` write)."""
        views, offset = [], slot * self.slot_bytes
        for t in like:
            n = t.numel() * t.element_size()
            raw = self.slots[offset:offset + n]
            views.append(raw.view(t.dtype).view(t.shape))
            offset += _aligned(n)
        return views

    def slot_of(self, tensors) -> int:
        """The slot holding `tensors` (from `buffers`), or -1."""
        if self.slots is None or not tensors:
            return -1
        base = self.slots.data_ptr()
        off = tensors[0].data_ptr() - base
        if 0 <= off < self.slot_bytes * _NUM_SLOTS and off % self.slot_bytes == 0:
            return off // self.slot_bytes
        return -1

    def _flag_addr(self, rank: int, index: int) -> int:
        return self._flag_base[rank] + 4 * index

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int) -> tuple:
        """Send `send` into the slot of rank+shift that corresponds to our `recv` slot, and
        receive into `recv` from rank-shift. Returns what `wait` needs."""
        slot = self.slot_of(recv)
        direction = 0 if shift == 1 else 1
        nxt, prv = (self.rank + shift) % self.world, (self.rank - shift) % self.world
        self.seq[direction][slot] += 1
        seq = self.seq[direction][slot]
        d = self.driver
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        side = self.stream_handles[direction][slot // 2]
        # sources are ready, and our previous uses of `recv` are enqueued, before the side stream goes on
        d.order(side, self.events_in[direction][slot // 2], compute)
        # 1. our recv slot is free again (everything that read it is enqueued before this point)
        d.write(side, self._flag_addr(prv, _flag_index(direction, 1, slot)), seq)
        # 2. wait until the next rank has freed its slot, copy into it, then flag it full
        d.wait(side, self._flag_addr(self.rank, _flag_index(direction, 1, slot)), seq)
        dst = self._slot_base[nxt] + slot * self.slot_bytes
        for src in send:
            if not src.is_contiguous():
                raise ValueError("copy-engine exchange: send tensors must be contiguous")
            n = src.numel() * src.element_size()
            d.copy(dst, src.data_ptr(), n, side)  # a copy engine over NVLink
            self._in_flight.append(src)
            dst += _aligned(n)
        d.write(side, self._flag_addr(nxt, _flag_index(direction, 0, slot)), seq)
        return (direction, slot, seq)

    def wait(self, pending: tuple) -> None:
        """Make the current stream wait until the data of this exchange has arrived. It does not
        wait for our own outgoing copy: slots are only rewritten after a later exchange frees
        them, ordered behind that copy on its side stream. `drain` waits for the copies."""
        direction, slot, seq = pending
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        self.driver.wait(compute, self._flag_addr(self.rank, _flag_index(direction, 0, slot)), seq)

    def drain(self) -> None:
        """Make the current stream wait for every outgoing copy (before the caller's tensors that
        were sent may be changed, and at the end of each ring call)."""
        compute = torch.cuda.current_stream(self.device_index).cuda_stream
        for direction in range(2):
            for kind in range(2):
                self.driver.order(compute, self.events_out[direction][kind], self.stream_handles[direction][kind])
        self._in_flight.clear()


def _aligned(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


_RINGS: dict = {}


def copy_engine_ring(pg: "dist.ProcessGroup", device: torch.device):
    """The copy-engine ring for `pg`, or None where it can't run (then NCCL is used)."""
    key = (_compat.name_of_group(pg), device.index)
    if key not in _RINGS:
        # Every rank must take the same path: agree first on what each can do locally.
        why = None
        try:
            _Driver()
            from torch.distributed import _symmetric_memory  # noqa: F401
        except Exception as e:  # no libcuda stream memory ops, no symmetric memory module, ...
            why = f"{type(e).__name__}: {e}"
        ok = torch.tensor([0 if why else 1], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        ring = None
        if ok.item():
            try:
                ring = CopyEngineRing(pg, device)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
        if ring is None:
            log.warning("dtcp: copy-engine ring unavailable (%s); using NCCL", why or "another rank lacks it")
        _RINGS[key] = ring
    return _RINGS[key]
