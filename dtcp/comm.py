"""Point-to-point ring exchange (gloo and NCCL), with byte counters for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    """Sends to the rank `shift` places ahead and receives from the rank `shift` places behind."""

    def __init__(self, pg: "dist.ProcessGroup"):
        self.pg = ring_group(pg)
        self.world_size = group_size(pg)
        self.rank = group_rank(pg)

    def _peer(self, offset: int) -> int:
        return global_rank(self.pg, (self.rank + offset) % self.world_size)

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int = 1) -> list:
        """Start sending `send` to rank+shift and receiving `recv` from rank-shift. Returns the
        works; call `wait` before reading `recv` or writing `send`."""
        to, frm = self._peer(shift), self._peer(-shift)
        ops = [dist.P2POp(dist.isend, t, to, self.pg) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.pg) for t in recv]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
