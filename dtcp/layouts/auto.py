"""Auto: the layout chosen per batch from its documents, for the integrations and `context_parallel`.

A batch that packs several documents into one row is sharded with `Balanced` (equal tokens and
equal causal work per rank, whatever the document mix); anything else (no documents, or rows
with documents of their own) with `Zigzag`. Zigzag balances causal work over the whole sequence,
not per document: on long-tailed mixes one rank holds up to 3x another's work (docs/guide/layouts.md).

`Auto()` itself holds no tokens: it names the choice. The integrations resolve it once per batch
with `resolve` and shard that batch with the result. The length rule is the stricter of the two
(a multiple of 2N), so that padding to `multiple(N)` suits either choice. They pass `resolve` the
ring steps whose host time the rest of a training step hides (`Balanced(hidden_steps=)`), from the
cost objective in force (`dtcp.hidden_ring_steps`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .balanced import MIN_CHUNK, Balanced
from .base import Layout
from .zigzag import Zigzag


#: what Auto resolves to without documents: one object, so that code reading it under torch.compile
#: (a guard on the object) sees the same one every batch
_ZIGZAG = Zigzag()


@dataclass(frozen=True)
class Auto(Layout):
    """Per batch: `Balanced` for one packed row of several documents, else `Zigzag`.
    `min_chunk`: Balanced's (the shortest chunk a cut document gets)."""

    min_chunk: int = dataclasses.field(default=MIN_CHUNK, kw_only=True)
    name = "auto"

    def __post_init__(self):
        # The Balanced without documents that attention calls take for a balanced batch (the
        # documents then travel as the cu_seqlens tensor): one object per Auto and hidden_steps,
        # not one per batch (torch.compile guards on the object).
        object.__setattr__(self, "_by_boundaries", {})

    def by_boundaries(self, resolved: Balanced) -> Balanced:
        """The Balanced without documents that gives the placement of `resolved` (a batch this Auto
        resolved to Balanced) when the call gets the batch's cu_seqlens: the same object for every
        batch resolved with the same options (min_chunk, hidden_steps): one a run, two under
        `dtcp.config.auto_placement = "fastest"` (the ring's placement and the one balancing the
        work alone: `dtcp.api.resolve_auto`)."""
        options = (resolved.min_chunk, resolved.hidden_steps)
        if options not in self._by_boundaries:
            self._by_boundaries[options] = Balanced(min_chunk=options[0], hidden_steps=options[1])
        return self._by_boundaries[options]

    def multiple(self, world_size: int) -> int:
        return 2 * world_size  # Zigzag's; Balanced needs only N

    def resolve(self, cu_seqlens: Union[torch.Tensor, Sequence[int], None], seq_len: Optional[int] = None,
                hidden_steps: int = 0) -> Layout:
        """The layout for a batch whose rows hold `seq_len` tokens each and whose document
        boundaries are `cu_seqlens` (None: no documents). Boundaries that end at `seq_len` are
        documents shared by every row: Balanced when two or more are non-empty. Boundaries over the
        rows flattened (ending at B * seq_len: each row its own documents) get Zigzag, as one
        placement cannot balance every row. `seq_len` None: the boundaries' last value.
        `hidden_steps`: Balanced's (the ring steps whose host time other device work hides)."""
        if cu_seqlens is None:
            return _ZIGZAG
        values = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if not values or (seq_len is not None and values[-1] != seq_len):
            return _ZIGZAG
        if sum(1 for a, b in zip(values, values[1:]) if b > a) < 2:
            return _ZIGZAG  # one document: Balanced would cut it zigzag-style anyway
        return Balanced.from_cu_seqlens(values, min_chunk=self.min_chunk, hidden_steps=hidden_steps)

    def runs(self, seq_len, world_size, rank):
        raise ValueError("layout='auto' is chosen per batch from its documents (dtcp.Auto().resolve(cu_seqlens, "
                         "seq_len)); pass the resolved layout here, e.g. dtcp.Balanced.from_cu_seqlens(cu_seqlens) "
                         "or dtcp.Zigzag()")

    def spec(self) -> str:
        return "auto" if self.min_chunk == MIN_CHUNK else f"auto@{self.min_chunk}"
