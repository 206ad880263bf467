"""dtcp: exact, compile-native context-parallel (ring) attention for PyTorch."""

from .api import flash_attn_varlen_func, ring_attention
from .comm import STATS as comm_stats
from .context import context_parallel, context_parallel_unshard, shard_buffers, unshard_buffers
from .dtensor import distribute_tensor, from_local, full_tensor, layout_placements, redistribute
from .layouts import Contiguous, DocZigzag, Layout, SlidingWindow, Striped, Zigzag, layout_from_spec
from .window import attention_window

__all__ = [
    "ring_attention",
    "flash_attn_varlen_func",
    "Layout",
    "Contiguous",
    "Zigzag",
    "Striped",
    "SlidingWindow",
    "DocZigzag",
    "attention_window",
    "layout_from_spec",
    "comm_stats",
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

__version__ = "0.1.0"
