"""`dtcp.attention_window`: a scoped default sliding window for the ring_attention calls inside.

Models that mix full and sliding-window layers (Gemma, gpt-oss) wrap the windowed layers:

    with dtcp.attention_window(4096):          # (4096, 0): causal sliding window of 4096
        x = windowed_layer(x)                   # its dtcp.ring_attention calls use the window
    x = full_layer(x)                           # no window

Precedence in `ring_attention`: an explicit `window_size=` argument, then the innermost
`attention_window`, then the window a `SlidingWindow` layout carries.
"""

from __future__ import annotations

from typing import Optional

from ..layouts import check_window

# A plain module-level stack rather than a ContextVar: torch.compile traces reads of a global
# list (and guards on it) but graph-breaks on ContextVar.get. It is per process, shared by threads.
_STACK: list[tuple[int, int]] = []


class attention_window:
    """Within the block, dtcp.ring_attention calls without `window_size=` use (left, right);
    (-1, -1) turns a layout's window off. Nests; usable inside torch.compile'd code."""

    def __init__(self, left: int, right: int = 0):
        self.window = check_window((left, right), "attention_window(left, right)")

    def __enter__(self) -> tuple[int, int]:
        _STACK.append(self.window)
        return self.window

    def __exit__(self, *exc) -> None:
        _STACK.pop()


def current_window() -> Optional[tuple[int, int]]:
    """The innermost attention_window's (left, right), or None outside any."""
    return _STACK[-1] if _STACK else None
