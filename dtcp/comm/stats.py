"""`dtcp.comm_stats`: what this process handed to the transport since the last reset.

Counted where the bytes leave: the point-to-point exchange counts the tensors it passes to the
backend (or copies with the copy engines), the collectives count their input tensors times the
peers that receive them. Tests and benchmarks compare these with independently computed sizes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    """Rounds and bytes sent by this process: K/V (forward, and re-sent in the backward), dK/dV,
    and the head exchange's all-to-alls (Ulysses: q/k/v, out/lse, dout and dq/dk/dv)."""

    kv_rounds: int = 0
    kv_bytes_sent: int = 0
    grad_rounds: int = 0
    grad_bytes_sent: int = 0
    heads_rounds: int = 0
    heads_bytes_sent: int = 0

    def reset(self) -> None:
        self.kv_rounds = self.kv_bytes_sent = self.grad_rounds = self.grad_bytes_sent = 0
        self.heads_rounds = self.heads_bytes_sent = 0

    def count(self, kind: str, nbytes: int) -> None:
        """One round of `kind` ("kv", "grad" or "heads") that sent `nbytes`."""
        if kind == "kv":
            self.kv_rounds += 1
            self.kv_bytes_sent += nbytes
        elif kind == "grad":
            self.grad_rounds += 1
            self.grad_bytes_sent += nbytes
        elif kind == "heads":
            self.heads_rounds += 1
            self.heads_bytes_sent += nbytes
        else:
            raise ValueError(f"CommStats.count: kind must be 'kv', 'grad' or 'heads'; got {kind!r}")


STATS = CommStats()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
