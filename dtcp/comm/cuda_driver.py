"""The few CUDA driver calls dtcp's GPU transport and failure handling make, from libcuda.

Stream memory operations (cuStreamWaitValue32_v2 / cuStreamWriteValue32_v2), which PyTorch does
not expose, and, for the per-transfer hot path, event record/wait and cuMemcpyAsync: a ctypes
call costs ~1 us, while torch.cuda's Stream/Event wrappers cost tens of microseconds each. This is
the CUDA driver's public API (CUDA >= 12 drivers), not a torch-private one.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


class Driver:
    """Streams and pointers are the CUDA runtime's own (cudaStream_t is a CUstream; device pointers
    are unified addresses)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        self.wait32 = self._fn(lib, "cuStreamWaitValue32_v2", [vp, u64, ctypes.c_uint32, ctypes.c_uint])
        self.write32 = self._fn(lib, "cuStreamWriteValue32_v2", [vp, u64, ctypes.c_uint32, ctypes.c_uint])
        self.memcpy = self._fn(lib, "cuMemcpyAsync", [u64, u64, ctypes.c_size_t, vp])
        self.event_create = self._fn(lib, "cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint])
        self.event_record = self._fn(lib, "cuEventRecord", [vp, vp])
        self.stream_wait_event = self._fn(lib, "cuStreamWaitEvent", [vp, vp, ctypes.c_uint])
        self.event_query = self._fn(lib, "cuEventQuery", [vp])

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
        self._check(self.event_create(ctypes.byref(ev), 0x2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return ev.value

    def record(self, event: int, stream: int) -> None:
        self._check(self.event_record(event, stream), "cuEventRecord")

    def done(self, event: int) -> bool:
        """Has the GPU passed the event's record point? (cuEventQuery: 0 done, 600 not ready.)"""
        err = self.event_query(event)
        if err not in (0, 600):
            self._check(err, "cuEventQuery")
        return err == 0

    def order(self, waiter: int, event: int, after: int) -> None:
        """Make stream `waiter` wait for the work enqueued so far on stream `after`."""
        self._check(self.event_record(event, after), "cuEventRecord")
        self._check(self.stream_wait_event(waiter, event, 0), "cuStreamWaitEvent")


@lru_cache(maxsize=1)
def driver() -> Driver:
    """The process's Driver (raises where libcuda or its stream memory operations are missing)."""
    return Driver()
