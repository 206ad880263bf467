"""The ring's point-to-point exchange: copy engines between CUDA neighbours, else batched P2P.

`RingComm.exchange(send, recv, shift, kind)` starts sending `send` to rank + shift and receiving
`recv` from rank - shift; `wait` makes the caller (host for gloo, current stream for NCCL and the
copy engines) wait for it. Waits are bounded: dtcp's communicator has `dtcp.config.timeout_s` as
its timeout, and the copy engines have a watchdog (dtcp/comm/copy_engine.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._groups import global_rank
from .stats import STATS, nbytes


class RingComm:
    """Exchanges between the ranks of one group on one device.

    On CUDA, transfers between neighbours (shift +-1) whose receive buffers come from
    `spare_buffers` go over the copy engines when the group agreed on them (dtcp.config.transport);
    every other transfer goes through `batch_isend_irecv` on dtcp's communicator. The choice
    depends only on the normalised shift and the buffer kind, so every rank makes the same one."""

    def __init__(self, state, device: torch.device, copy_engine=None):
        self.state = state
        self.pg = state.comm_group()
        self.world_size, self.rank = state.size, state.rank
        self.copy_engine = copy_engine
        self.exchanges = {"copy_engine": 0, "p2p": 0}  # by path taken, for tests and benchmarks

    def spare_buffers(self, like: list[torch.Tensor], kind: str) -> list[list[torch.Tensor]]:
        """Two receive buffers shaped like `like`. kind: "kv" or "grad" (separate slots). On the
        copy engines the slots must already be sized (CopyEngineRing.ensure) for `like`."""
        if self.copy_engine is not None:
            return self.copy_engine.buffers(like, kind)
        return [[torch.empty_like(t, memory_format=torch.contiguous_format) for t in like] for _ in range(2)]

    def _peer(self, offset: int) -> int:
        return global_rank(self.pg, (self.rank + offset) % self.world_size)

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int, kind: str) -> list:
        """Start the exchange; returns what `wait` takes. Call `wait` before reading `recv` or
        writing `send`."""
        n = self.world_size
        shift = (shift + n // 2) % n - n // 2 if n > 1 else 0  # ranks may name a neighbour as +k or k - N
        STATS.count(kind, nbytes(send))
        if self.copy_engine is not None and abs(shift) == 1:
            self.exchanges["copy_engine"] += 1
            return [("copy_engine", self.copy_engine.exchange([t.contiguous() for t in send], recv, shift, kind))]
        self.exchanges["p2p"] += 1
        to, frm = self._peer(shift), self._peer(-shift)
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.pg) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.pg) for t in recv]
        return dist.batch_isend_irecv(ops)

    def wait(self, works: list) -> None:
        for w in works:
            if isinstance(w, tuple) and w[0] == "copy_engine":
                self.copy_engine.wait(w[1])
            else:
                w.wait()

    def drain(self) -> None:
        """Make the current stream wait for every outgoing copy-engine transfer (before the
        caller's tensors that were sent may change, and at the end of each ring call)."""
        if self.copy_engine is not None:
            self.copy_engine.drain()

    def finish(self) -> None:
        """End of a ring call: every outgoing copy is ordered before what follows."""
        self.drain()


class NoComm:
    """Stand-in for RingComm that moves nothing: each step reuses the rank's own K/V (the
    benchmarks' no-communication ideal)."""

    @staticmethod
    def spare_buffers(like, kind):
        return [[torch.empty_like(t) for t in like] for _ in range(2)]

    def exchange(self, send, recv, shift: int, kind: str):
        return None

    @staticmethod
    def wait(works) -> None:
        pass

    @staticmethod
    def drain() -> None:
        pass

    @staticmethod
    def finish() -> None:
        pass
