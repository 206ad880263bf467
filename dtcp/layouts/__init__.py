"""Sequence layouts: which global tokens each rank of a context-parallel group holds.

Pure index math (one module per layout) plus `sharding`, which applies it to tensors.

    Contiguous()        rank 0: 0 1 2 3 4 5 6 7          rank 1: 8 9 10 11 12 13 14 15
    Zigzag()            rank 0: 0 1 2 3 | 12 13 14 15    rank 1: 4 5 6 7 | 8 9 10 11
    Striped(block=1)    rank 0: 0 2 4 6 8 10 12 14       rank 1: 1 3 5 7 9 11 13 15
    Striped(block=2)    rank 0: 0 1 4 5 8 9 12 13        rank 1: 2 3 6 7 10 11 14 15
"""

from __future__ import annotations

from .auto import Auto
from .balanced import Balanced, balanced_options
from .base import Layout, check_window
from .contiguous import Contiguous, SlidingWindow
from .doczigzag import DocZigzag
from .grouped import Grouped
from .striped import Striped
from .zigzag import Zigzag

__all__ = ["Layout", "Auto", "Contiguous", "Zigzag", "Striped", "SlidingWindow", "DocZigzag", "Balanced", "Grouped", "layout_from_spec",
           "check_window", "DEFAULT_LAYOUT"]

#: the layout of every function that takes one, unless told otherwise (balanced causal work)
DEFAULT_LAYOUT = Zigzag()


def layout_from_spec(spec: "str | Layout") -> Layout:
    """Inverse of `Layout.spec()`; also accepts a Layout and returns it."""
    if isinstance(spec, Layout):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"layout must be a dtcp Layout or its name; got {type(spec).__name__}")
    name, _, arg = spec.partition(":")
    name = name.strip().lower()
    try:
        if name == "contiguous":
            return Contiguous()
        if name == "zigzag":
            return Zigzag()
        if name.partition("@")[0] == "auto":  # "auto[@min_chunk]"
            min_chunk = name.partition("@")[2]
            return Auto(min_chunk=int(min_chunk)) if min_chunk else Auto()
        if name == "striped":
            return Striped(int(arg) if arg else 1)
        if name == "doczigzag" and arg:
            return DocZigzag(tuple(int(n) for n in arg.split(",") if n))
        options = balanced_options(name)
        if options is not None:  # "balanced[@min_chunk][+hidden_steps][:len,len,...]"
            docs = tuple(int(n) for n in arg.split(",") if n) if arg else None
            return Balanced(docs, **options)
        if name == "grouped":
            inner, _, base = arg.partition(":")
            return Grouped(layout_from_spec(base), int(inner))
        if name == "window":
            left, _, right = arg.partition(":")
            return SlidingWindow(int(left), int(right) if right else 0)
    except ValueError as e:
        raise ValueError(f"layout {spec!r}: {e}") from None
    raise ValueError(f"unknown layout {spec!r}; use 'auto', 'contiguous', 'zigzag', 'striped[:block]', 'window:left[:right]' "
                     "'doczigzag:len,len,...' or 'balanced[@min_chunk][+hidden_steps][:len,len,...]'")
