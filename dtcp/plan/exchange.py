"""Strategies and exchanges: how a call's work is spread (pure: shapes, layout, device, settings).

A *strategy* is what the user picks (`strategy=`): "ring", "allgather" (K/V move, each rank keeps
its tokens), "ulysses" (heads are exchanged for tokens, then local attention over the whole
sequence), "hybrid" (Ulysses inside the groups of a 2-D mesh, ring or all-gather across them) or
"auto" (the cost model, dtcp/plan/cost.py). An *exchange* is how K/V move once any head exchange
is done: "ring" or "allgather" (a group of one rank exchanges nothing).

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
STRATEGIES = ("auto", "ring", "allgather", "ulysses", "hybrid")


def check_kv_exchange(value: str) -> None:
    if value not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}; got {value!r}")


def check_strategy(value: str, two_dim: bool) -> None:
    """`strategy` against the group: "hybrid" needs a 2-D CP mesh, the others a 1-D group."""
    if value not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {value!r}")
    if value == "hybrid" and not two_dim:
        raise ValueError("strategy='hybrid' needs a 2-D context-parallel mesh (ring dim, ulysses dim): pass "
                         "group=mesh['cp_ring', 'cp_ulysses'] (a 2-D DeviceMesh) or group=(ring_group, ulysses_group)")
    if two_dim and value not in ("hybrid", "auto"):
        raise ValueError(f"strategy={value!r} runs on a 1-D group, and group is a 2-D mesh: use strategy='hybrid' "
                         "(or 'auto'), or pass one flattened 1-D group")


def exchange_candidates(requested: str, layout: Layout, local_len: int, world_size: int, device_type: str,
                        gathered_kv_bytes: int, allgather_max_bytes: int, documents: bool = False) -> tuple[str, ...]:
    """The exchanges to try, best first. An explicit request is the only candidate. `auto` puts the
    all-gather first on CUDA for one-or-two-run layouts (contiguous, zigzag; with `documents`, any
    layout, whose tasks may then be one varlen launch: the route falls back where not) when the gathered
    K/V is at most `allgather_max_bytes` (measured on 2 H200s: ahead of the ring at 16 MiB,
    behind from 32 MiB; docs/performance.md), and keeps the ring as the fallback; elsewhere (and
    always on CPU, where the all-gather was not measured to be faster) only the ring."""
    if requested not in KV_EXCHANGES:
        raise ValueError(f"exchange must be one of {KV_EXCHANGES}; got {requested!r}")
    if requested != "auto":
        return (requested,)
    if (device_type == "cuda" and world_size > 1 and gathered_kv_bytes <= allgather_max_bytes
            and allgather_reason(layout, local_len, world_size, documents) is None):
        return ("allgather", "ring")
    return ("ring",)
