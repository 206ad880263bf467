"""dtcp: exact, compile-native context-parallel (ring) attention for PyTorch."""

from .api import ring_attention
from .comm import STATS as comm_stats
from .layouts import Contiguous, Layout, Striped, Zigzag, layout_from_spec
from .context import context_parallel, context_parallel_unshard, shard_buffers, unshard_buffers
from .dtensor import distribute_tensor, from_local, full_tensor, layout_placements, redistribute

__all__ = [
    "ring_attention",
    "Layout",
    "Contiguous",
    "Zigzag",
    "Striped",
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
