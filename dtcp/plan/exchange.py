"""How K/V reach the other ranks: the exchange policy (pure: shapes, layout, device, settings).

"ring": blocks travel around the ring, each transfer overlapped with the previous block's kernels
(the choice for long sequences). "allgather": one all-gather of K/V, one kernel call per run of
local queries and one reduce-scatter of dK/dV (short sequences, where a ring call is bound by host
time). "auto": the all-gather on CUDA when the gathered K/V is small, else the ring. Which kernels
can serve a schedule is decided where kernels are known (dtcp/exec/route.py), which may fall back
from one exchange to the other.
"""

from __future__ import annotations

from ..layouts import Layout
from .allgather import allgather_reason

KV_EXCHANGES = ("auto", "ring", "allgather")


def check_kv_exchange(value: str) -> None:
    if value not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}; got {value!r}")


def exchange_candidates(requested: str, layout: Layout, local_len: int, world_size: int, device_type: str,
                        gathered_kv_bytes: int, allgather_max_bytes: int) -> tuple[str, ...]:
    """The exchanges to try, best first. An explicit request is the only candidate. `auto` puts the
    all-gather first on CUDA for one-or-two-run layouts (contiguous, zigzag) when the gathered
    K/V is at most `allgather_max_bytes` (measured on 2 H200s: ahead of the ring at 16 MiB,
    behind from 32 MiB; docs/performance.md), and keeps the ring as the fallback; elsewhere (and
    always on CPU, where the all-gather was not measured to be faster) only the ring."""
    check_kv_exchange(requested)
    if requested != "auto":
        return (requested,)
    if (device_type == "cuda" and world_size > 1 and gathered_kv_bytes <= allgather_max_bytes
            and allgather_reason(layout, local_len, world_size) is None):
        return ("allgather", "ring")
    return ("ring",)
