"""dtcp: exact, compile-native context-parallel (ring) attention for PyTorch."""

from .api import flash_attn_varlen_func, ring_attention
from .comm import STATS as comm_stats
from .layouts import Contiguous, DocZigzag, Layout, SlidingWindow, Striped, Zigzag, layout_from_spec
from .window import attention_window

__all__ = [
    "ring_attention",
    "flash_attn_varlen_func",
    "DocZigzag",
    "Layout",
    "Contiguous",
    "Zigzag",
    "Striped",
    "SlidingWindow",
    "attention_window",
    "layout_from_spec",
    "comm_stats",
]

__version__ = "0.1.0"
