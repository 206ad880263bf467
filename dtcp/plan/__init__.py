"""The planner: masks, tasks and per-step schedules, pure Python over integers (no process group,
no tensors). `ring` and `allgather` build every rank's plan; `ulysses` the head exchange;
`exchange` holds the strategy names and the exchange policy; `cost` the model `strategy="auto"`
ranks strategies with."""

from .allgather import (AllGatherPlan, KeyExchange, VarlenPlan, allgather_plans, allgather_reason, varlen_plans,
                        varlen_reason)
from .documents import chunk_segments, row_cu_seqlens, segments_from_cu_seqlens
from .cost import (MACHINES, CallShape, Machine, Prediction, decoder_layer_flops_per_token, plan_pairs, predict,
                   task_pairs)
from .exchange import KV_EXCHANGES, STRATEGIES, check_kv_exchange, check_strategy, exchange_candidates
from .mask import AttnMask, Band, Task, band_tasks
from .ring import RingPlan, Step, ring_plan, ring_plans
from .ulysses import HeadSplit, UlyssesPlan, head_splits, inner_layout, ulysses_plan

__all__ = [
    "AllGatherPlan", "KeyExchange", "VarlenPlan", "varlen_plans", "chunk_segments", "allgather_plans", "allgather_reason", "varlen_reason", "row_cu_seqlens",
    "segments_from_cu_seqlens", "KV_EXCHANGES", "check_kv_exchange", "exchange_candidates", "AttnMask", "Band",
    "Task", "band_tasks", "RingPlan", "Step", "ring_plan", "ring_plans", "STRATEGIES", "check_strategy",
    "MACHINES", "CallShape", "Machine", "Prediction", "decoder_layer_flops_per_token", "plan_pairs", "predict",
    "task_pairs", "HeadSplit",
    "UlyssesPlan", "head_splits", "inner_layout", "ulysses_plan",
]
