"""The block's state: what dtcp's attention function reads inside a `context_parallel` block.

The block (block.py) sets `ACTIVE` for the duration of the forward/backward; the attention
function (attention_function.py) and the mask function read it. None outside every block."""

from __future__ import annotations

from typing import Optional

import torch

from ...layouts import Layout


class _Active:
    """What the attention function needs inside a block: the group, the layout, the options, the
    current batch's global document boundaries and shard shape, and a write-only flag saying a
    "dtcp" attention call ran (write-only, so torch.compile replays it as a side effect without
    guarding on its value).

    The boundaries live here, not only in the model's keyword arguments, because a model may drop
    ``**kwargs`` on the way from its forward to its attention modules (some decoder layers call
    ``self.self_attn(hidden_states, ...)`` without them): the attention function would then attend
    across documents, silently."""

    def __init__(self, group, layout: Layout, backend: str, strategy: str):
        self.group, self.layout, self.backend, self.strategy = group, layout, backend, strategy
        # the block's layout as configured; `layout` is what the attention calls take (for "auto":
        # set per batch by the block)
        self.configured_layout = layout
        self.seen = False
        # set by the block for each batch (None when the block was given no batch)
        self.cu_seqlens: Optional[torch.Tensor] = None   # (K,) int32 global boundaries over B*S, or None
        self.shard: Optional[tuple[int, int]] = None     # (B, S/N): the shape every attention call's rows have
        # the sliding windows of the masks the model asked for in this block (None: a plain causal
        # mask), in the order asked; chunked masks are not listed (see attention_function.mask)
        self.mask_windows: tuple = ()


ACTIVE: Optional[_Active] = None
# One state object per configuration, reused from step to step: dynamo guards on the object a
# compiled attention call reads, so a fresh one every step would recompile every step.
_STATES: dict = {}


def state_for(group, layout: Layout, backend: str, strategy: str) -> _Active:
    key = (group, layout, backend, strategy)
    try:
        hash(key)
    except TypeError:
        return _Active(group, layout, backend, strategy)
    state = _STATES.get(key)
    if state is None:
        if len(_STATES) >= 16:
            _STATES.pop(next(iter(_STATES)))
        state = _STATES[key] = _Active(group, layout, backend, strategy)
    return state
