"""Collectives of the all-gather schedule and of the head exchange (Ulysses), counted in
dtcp.comm_stats where they are issued. A group of one rank exchanges nothing: its
collectives return their input."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _compat
from .stats import STATS


def all_gather_kv(send: torch.Tensor, pg: "dist.ProcessGroup", world_size: int) -> torch.Tensor:
    """(N * send.shape[0], ...): every rank's `send` (its stacked K and V), rank-major. Counted as one
    K/V round: this rank's tensor reaches N - 1 peers."""
    if world_size == 1:
        return send
    # flat along dim 0: gloo takes no stacked shape
    gathered = send.new_empty((world_size * send.shape[0],) + send.shape[1:])
    _compat.all_gather_into(gathered, send, pg)
    STATS.count("kv", (world_size - 1) * send.numel() * send.element_size())
    return gathered


def reduce_scatter_dkv(send: torch.Tensor, pg: "dist.ProcessGroup", world_size: int) -> torch.Tensor:
    """(send.shape[0] / N, ...): the sum over ranks of this rank's part of `send` (every rank's
    stacked dK and dV shares, rank-major). Counted as one dK/dV round: the N - 1 parts that are not
    this rank's leave it."""
    if world_size == 1:
        return send
    mine = send.new_empty((send.shape[0] // world_size,) + send.shape[1:])
    _compat.reduce_scatter_into(mine, send, pg)
    STATS.count("grad", (send.numel() - mine.numel()) * send.element_size())
    return mine


def exchange_rows(send: torch.Tensor, send_rows: tuple[int, ...], recv_rows: tuple[int, ...],
                  pg: "dist.ProcessGroup", kind: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(sum(send_rows), ...) -> (sum(recv_rows), ...): rows send_rows[j] of `send` (in rank order)
    go to rank j, and rank i's rows for this rank arrive as the result's recv_rows[i] rows, in rank
    order. The all-gather's sparse form (exec/allgather.py, plan.KeyExchange). Every rank must
    call it, each with the splits its plan gives; no row goes to the rank itself. Counted under
    `kind` ("kv" or "grad"). `out`: a contiguous tensor of the result's shape to receive into."""
    shape = (sum(recv_rows),) + tuple(send.shape[1:])
    if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
        raise ValueError(f"exchange_rows: out must be contiguous of shape {shape}; got {tuple(out.shape)}")
    recv = send.new_empty(shape) if out is None else out
    dist.all_to_all_single(recv, send, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows), group=pg)
    STATS.count(kind, send.numel() * send.element_size())
    return recv


def all_to_all_bytes(send: torch.Tensor, pg: "dist.ProcessGroup", world_size: int) -> torch.Tensor:
    """(U, row) uint8 -> (U, row) uint8: row j of the result is rank j's row for this rank (each
    rank's row u goes to rank u). Counted as one head-exchange round: the U - 1 rows that are not
    this rank's leave it."""
    if world_size == 1:
        return send
    recv = torch.empty_like(send)
    _compat.all_to_all_into(recv, send, pg)
    STATS.count("heads", (world_size - 1) * send.shape[1])
    return recv


def all_gather_traceable(x: torch.Tensor, pg: "dist.ProcessGroup") -> torch.Tensor:
    """Differentiable all-gather along dim 0 that torch.compile traces into the graph (its backward
    is a reduce-scatter). Not counted: traced graphs run no Python per call."""
    return _compat.all_gather_autograd(x, pg)
