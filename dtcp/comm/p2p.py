"""The ring's point-to-point exchange: copy engines between CUDA neighbours, else batched P2P.

`RingComm.exchange(send, recv, shift, kind)` starts sending `send` to rank + shift and receiving
`recv` from rank - shift; `wait` makes the caller (host for gloo, current stream for NCCL and the
copy engines) wait for it. Waits are bounded: dtcp's communicator has `dtcp.config.timeout_s` as
its timeout, and the copy engines have a watchdog (dtcp/comm/copy_engine.py).
"""

from __future__ import annotations

import math

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

    def spare_buffers(self, like: list[torch.Tensor], kind: str, dtype=None) -> list[list[torch.Tensor]]:
        """Two receive slots, each holding tensors shaped like `like` (the largest a round of this
        call receives), in `dtype` if given. kind: "kv" or "grad" (separate slots). On the copy
        engines the slots must already be sized (CopyEngineRing.ensure) for them."""
        if self.copy_engine is not None:
            return self.copy_engine.buffers(like, kind, dtype)
        return new_slots(like, dtype)

    def fit(self, slot: list[torch.Tensor], shapes: list[tuple], kind: str) -> list[torch.Tensor]:
        """Contiguous views of one slot of `spare_buffers`, shaped `shapes` (each no larger than
        the slot's tensor), laid out as this transport delivers them: a round that receives
        fewer keys than the largest receives into the same slot."""
        if self.copy_engine is not None:
            return self.copy_engine.fit(slot, shapes, kind)
        return fit_views(slot, shapes)

    def _peer(self, offset: int) -> int:
        return global_rank(self.pg, (self.rank + offset) % self.world_size)

    def exchange(self, send: list[torch.Tensor], recv: list[torch.Tensor], shift: int, kind: str, slot: int,
                 direct: bool = False) -> list:
        """Start the exchange; returns what `wait` takes. Call `wait` before reading `recv` or
        writing `send`. `recv` lies in spare slot `slot` (0 or 1), or anywhere with `direct`
        (point-to-point on the communicator whatever the shift: the grouped ring's own buffers).
        Empty tensors move nothing: the peer's matching tensor is empty too (both sides size them
        from the same plan)."""
        n = self.world_size
        shift = (shift + n // 2) % n - n // 2 if n > 1 else 0  # ranks may name a neighbour as +k or k - N
        STATS.count(kind, nbytes(send))
        if self.copy_engine is not None and abs(shift) == 1 and not direct:
            self.exchanges["copy_engine"] += 1
            return [("copy_engine", self.copy_engine.exchange([t.contiguous() for t in send], recv, shift, kind, slot))]
        self.exchanges["p2p"] += 1
        to, frm = self._peer(shift), self._peer(-shift)
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.pg) for t in send if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, frm, self.pg) for t in recv if t.numel()]
        return dist.batch_isend_irecv(ops) if ops else []

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


def new_slots(like: list[torch.Tensor], dtype=None) -> list[list[torch.Tensor]]:
    """Two freshly allocated, contiguous slots shaped like `like` (in `dtype` if given)."""
    return [[torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like] for _ in range(2)]


def fit_views(slot: list[torch.Tensor], shapes: list[tuple]) -> list[torch.Tensor]:
    """The leading elements of each (contiguous) tensor of `slot`, viewed as the matching shape
    (contiguous): t.view(-1)[:numel].view(shape) in one tensor op instead of three."""
    views = []
    for t, shape in zip(slot, shapes):
        numel = math.prod(shape)
        if numel > t.numel() or not t.is_contiguous():
            raise RuntimeError(f"dtcp: a receive of shape {tuple(shape)} does not fit its slot {tuple(t.shape)} (a dtcp bug)")
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        views.append(t.as_strided(tuple(shape), tuple(reversed(strides)), t.storage_offset()))
    return views


class NoComm:
    """Stand-in for RingComm that moves nothing: each step reuses the rank's own K/V (the
    benchmarks' no-communication ideal).

    Where an executor reads received blocks from its own buffer (the ring's in-place groups,
    exec/grouped.py), `stand_in(key, make, owner)` gives the buffer the receives would have filled: made
    by `make()` on a key's first use and kept by this object, so the time a pass pays for it is
    the transport's, which NoComm leaves out (as the ring's stand-in reads the rank's own block in
    place). Its values are the rank's own keys, as every NoComm block's are. A benchmark keeps one
    NoComm per simulated rank and plan."""

    def __init__(self):
        self._stand_ins: dict = {}

    def stand_in(self, key, make, owner):
        """The buffer for `key` of `owner` (a plan: held here, so its id names no other while kept)."""
        hit = self._stand_ins.get(key)
        if hit is None or hit[0] is not owner:
            hit = self._stand_ins[key] = (owner, make())
        return hit[1]

    @staticmethod
    def spare_buffers(like, kind, dtype=None):
        return new_slots(like, dtype)

    @staticmethod
    def fit(slot, shapes, kind):
        return fit_views(slot, shapes)

    def exchange(self, send, recv, shift: int, kind: str, slot: int, direct: bool = False):
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
