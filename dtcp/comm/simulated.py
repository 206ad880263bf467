"""N ranks of a ring in one process: one thread per rank, one device, real received blocks.

For checking the ring's numerics on one GPU when no multi-GPU machine is at hand: each rank runs
the real `ring_forward` / `ring_backward` (dtcp/exec/ring.py) on its own shards, and every
transfer delivers the sender's actual tensors (a copy taken when the sender issues it), so the
merges, the travelling dK/dV and the chains' ends all run as on N devices. Only the transport
differs. Threads share the device's stream, so a copy issued before a message is posted is
ordered before the receiver's read of it.

    ring = SimulatedRing(4)
    results = ring.run(lambda rank, comm: ring_forward(q[rank], k[rank], v[rank], plans[rank], kernel, s, comm))

Kernels are called under one lock (`locked`): a kernel that compiles on first use (FA4) then
compiles once, not from N threads at a time.
"""

from __future__ import annotations

import threading
from typing import Callable

from .p2p import fit_views, new_slots


class SimulatedRing:
    """The shared mailbox of `world_size` simulated ranks."""

    def __init__(self, world_size: int, timeout_s: float = 300.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._boxes: dict = {}
        self._cv = threading.Condition()
        self._failed: list = []

    def comm(self, rank: int) -> "SimulatedComm":
        return SimulatedComm(self, rank)

    def post(self, key, tensors) -> None:
        with self._cv:
            self._boxes[key] = tensors
            self._cv.notify_all()

    def take(self, key):
        with self._cv:
            ok = self._cv.wait_for(lambda: key in self._boxes or self._failed, timeout=self.timeout_s)
            if self._failed:
                raise RuntimeError(f"simulated ring: another rank failed: {self._failed[0]!r}")
            if not ok:
                raise TimeoutError(f"simulated ring: no message {key} within {self.timeout_s} s")
            return self._boxes.pop(key)

    def run(self, fn: Callable[[int, "SimulatedComm"], object]) -> list:
        """fn(rank, comm) on every rank, each in its own thread; the results in rank order. An
        error on one rank wakes the others and is raised here."""
        results, errors = [None] * self.world_size, [None] * self.world_size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.comm(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
                errors[rank] = e
                with self._cv:
                    self._failed.append(e)
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and "another rank failed" not in str(e)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class SimulatedComm:
    """The ring's exchange interface (as dtcp.comm.p2p.RingComm) for one simulated rank."""

    def __init__(self, ring: SimulatedRing, rank: int):
        self.ring, self.rank = ring, rank
        self._count: dict = {}

    @staticmethod
    def spare_buffers(like, kind, dtype=None):
        return new_slots(like, dtype)

    @staticmethod
    def fit(slot, shapes, kind):
        return fit_views(slot, shapes)

    def exchange(self, send, recv, shift: int, kind: str, slot: int, direct: bool = False):
        # Every rank makes the same exchanges in the same order: the i-th of a kind pairs up.
        n = self.ring.world_size
        i = self._count[kind] = self._count.get(kind, -1) + 1
        to, frm = (self.rank + shift) % n, (self.rank - shift) % n
        self.ring.post((to, self.rank, kind, i), [t.clone() for t in send])
        return ((self.rank, frm, kind, i), recv)

    def wait(self, works) -> None:
        if works is None:
            return
        key, recv = works
        for dst, src in zip(recv, self.ring.take(key)):
            dst.copy_(src)

    @staticmethod
    def drain() -> None:
        pass

    @staticmethod
    def finish() -> None:
        pass


class LockedKernel:
    """A kernel whose calls hold one lock (see the module docstring); attributes pass through."""

    _lock = threading.Lock()

    def __init__(self, kernel):
        self._kernel = kernel

    def __getattr__(self, name):
        attr = getattr(self._kernel, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with LockedKernel._lock:
                return attr(*args, **kwargs)

        return call


def locked(kernel) -> LockedKernel:
    return LockedKernel(kernel)


__all__ = ["SimulatedRing", "SimulatedComm", "locked"]
