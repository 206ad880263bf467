"""The planner: masks, tasks and per-step schedules, pure Python over integers (no process group,
no tensors). `ring` and `allgather` build every rank's plan; `exchange` picks between them."""

from .allgather import AllGatherPlan, VarlenPlan, allgather_plans, allgather_reason, varlen_reason
from .documents import row_cu_seqlens, segments_from_cu_seqlens
from .exchange import KV_EXCHANGES, check_kv_exchange, exchange_candidates
from .mask import AttnMask, Band, Task, band_tasks
from .ring import RingPlan, Step, ring_plan, ring_plans

__all__ = [
    "AllGatherPlan", "VarlenPlan", "allgather_plans", "allgather_reason", "varlen_reason", "row_cu_seqlens",
    "segments_from_cu_seqlens", "KV_EXCHANGES", "check_kv_exchange", "exchange_candidates", "AttnMask", "Band",
    "Task", "band_tasks", "RingPlan", "Step", "ring_plan", "ring_plans",
]
