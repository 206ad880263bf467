"""dtcp: exact, compile-native context-parallel attention for PyTorch.

The pipeline, one folder per stage (docs/architecture.md):
layouts/ -> plan/ -> comm/ + kernels/ -> exec/ -> ops.py -> api.py, frontends/ -> integrations/
"""

from . import errors
from .api import calibrate, explain, flash_attn_varlen_func, hidden_ring_steps, ring_attention
from .comm.stats import STATS as comm_stats
from .config import config
from .frontends.context import context_parallel, context_parallel_unshard, shard_buffers, unshard_buffers
from .frontends.dtensor import distribute_tensor, from_local, full_tensor, layout_placements, redistribute
from .frontends.window import attention_window
from .layouts import Auto, Balanced, Contiguous, DocZigzag, Layout, SlidingWindow, Striped, Zigzag, layout_from_spec

__all__ = [
    "ring_attention",
    "flash_attn_varlen_func",
    "explain",
    "hidden_ring_steps",
    "calibrate",
    "Layout",
    "Contiguous",
    "Zigzag",
    "Striped",
    "SlidingWindow",
    "DocZigzag",
    "Auto",
    "Balanced",
    "attention_window",
    "layout_from_spec",
    "comm_stats",
    "config",
    "errors",
    "context_parallel",
    "context_parallel_unshard",
    "shard_buffers",
    "unshard_buffers",
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "redistribute",
    "layout_placements",
]

__version__ = "0.2.0"
