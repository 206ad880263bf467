"""Point-to-point ring exchange (gloo and NCCL), with byte counters for tests and benchmarks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _compat
from ._groups import global_rank, group_rank, group_size, ring_group


@dataclass
class CommStats:
    """Counters of what this process sent through the ring since the last reset."""

    kv_rounds: int = 0
    kv_bytes_sent: int = 0
    grad_rounds: int = 0
    grad_bytes_sent: int = 0

    def reset(self) -> None:
        self.kv_rounds = self.kv_bytes_sent = self.grad_rounds = self.grad_bytes_sent = 0


STATS = CommStats()


class RingComm:
    """Sends to the rank `shift` places ahead and receives from the rank `shift` places behind.

    On CUDA, transfers between neighbours whose receive buffers come from `spare_buffers` go over
    the copy engines (see ce_transport.py; DTCP_TRANSPORT=nccl turns that off); everything else
    goes through `batch_isend_irecv` (NCCL on a high-priority stream, or gloo)."""

    def __init__(self, pg: "dist.ProcessGroup", device: "torch.device | None" = None):
        self.pg = ring_group(pg)
        self.world_size = group_size(pg)
        self.rank = group_rank(pg)
        self.ce = None
        if device is not None and device.type == "cuda" and self.world_size > 1 and os.environ.get("DTCP_TRANSPORT", "ce") == "ce":
            from .ce_transport import copy_engine_ring

            self.ce = copy_engine_ring(pg, device)

    def spare_buffers(self, like: list[torch.Tensor], kind: str) -> list[list[torch.Tensor]]:
        """Two receive buffers shaped like `like`. kind: "kv" or "grad" (separate slots)."""
        if self.ce is not None:
            return self.ce.buffers(like, first_slot=0 if kind == "kv" else 2)
        return [[torch.empty_like(t, memory_format=torch.contiguous_format) for t in like] for _ in range(2)]

    def _peer(self, offset: int) -> int:
        return global_rank(self.pg, (self.rank + offset) % self.world_size)

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int = 1) -> list:
        """Start sending `send` to rank+shift and receiving `recv` from rank-shift. Returns the
        works; call `wait` before reading `recv` or writing `send`. Every rank makes the same
        choice of path: the choice depends only on the normalised shift and the buffers' slots."""
        # Normalise the shift: ranks may name the same neighbour as +k or k - N.
        n = self.world_size
        shift = (shift + n // 2) % n - n // 2 if n > 1 else 0
        if self.ce is not None and abs(shift) == 1 and self.ce.slot_of(recv) >= 0:
            return [("ce", self.ce.exchange([t.contiguous() for t in send], recv, shift))]
        to, frm = self._peer(shift), self._peer(-shift)
        ops = [dist.P2POp(dist.isend, t, to, self.pg) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.pg) for t in recv]
        return dist.batch_isend_irecv(ops)

    def drain(self) -> None:
        """Wait (on the current stream) for every outgoing copy-engine transfer."""
        if self.ce is not None:
            self.ce.drain()

    def wait(self, works: list) -> None:
        for w in works:
            if isinstance(w, tuple) and w[0] == "ce":
                self.ce.wait(w[1])
            else:
                w.wait()


_COMMS: dict = {}


def ring_comm(pg: "dist.ProcessGroup", device: "torch.device") -> RingComm:
    """The RingComm for (pg, device), made once: building one resolves groups, backends and the
    copy-engine ring, which is too slow for every call of a small ring (eager, short sequences)."""
    key = (_compat.name_of_group(pg), device.type, device.index, os.environ.get("DTCP_TRANSPORT", "ce"),
           os.environ.get("DTCP_HIGH_PRIORITY_RING", "1"))
    comm = _COMMS.get(key)
    if comm is None:
        comm = _COMMS[key] = RingComm(pg, device)
    return comm


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
