"""DocZigzag: per-document zigzag over packed documents (causal load balance for varlen).

Each document is padded at its end to a multiple of 2N and cut into 2N equal chunks; rank r
holds chunk r and chunk 2N-1-r of every document, documents in order. Picture, N = 2, documents
of 5 and 3 tokens (p = padding; chunks of 2 and 1):

    padded:  a0 a1 a2 a3 a4 p p p | b0 b1 b2 p
    rank 0:  a0 a1 . p p  | b0 . p        rank 1:  a2 a3 . a4 p | b1 . b2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._groups import GroupLike
from . import sharding
from .base import Layout, documents_of, documents_tensor
from .zigzag import zigzag_runs


@dataclass(frozen=True)
class DocZigzag(Layout):
    """Per-document zigzag for causal attention over packed documents (load balance).

    The layout carries its documents, so `ring_attention(..., layout=DocZigzag(...))` applies the
    document mask by itself; padding tokens see nothing and are seen by nobody (out 0, lse 0,
    zero gradients). The documents also travel as a tensor, `cu_seqlens` (int32 boundaries of the
    unpadded packed sequence), which is all that dtcp reads of the layout inside
    `torch.compile`: a new document structure every batch is a new input, not a new graph.

    The tensors it shards are *padded*: use `shard_packed` (packed tokens -> this rank's padded
    shard), `loss_mask` (True on real tokens: multiply the loss by it) and `unshard_packed`.
    """

    doc_lens: tuple[int, ...] = ()
    name = "doczigzag"

    def __post_init__(self):
        # A private tensor (not a dataclass field: equality and hashing stay by value).
        object.__setattr__(self, "cu_seqlens", documents_tensor(self.doc_lens, "DocZigzag"))

    @staticmethod
    def from_cu_seqlens(cu_seqlens) -> "DocZigzag":
        """From global boundaries of the packed (unpadded) sequence: a list or an int tensor."""
        return DocZigzag(documents_of(cu_seqlens, "DocZigzag"))

    def _padded(self, world_size: int) -> list[tuple[int, int, int]]:
        """(padded start, real length, padded length) per non-empty document."""
        m, out, start = 2 * world_size, [], 0
        for n in self.doc_lens:
            if n:
                p = -(-n // m) * m
                out.append((start, n, p))
                start += p
        return out

    def padded_len(self, world_size: int) -> int:
        """Length of the padded sequence over `world_size` ranks."""
        return sum(p for _, _, p in self._padded(world_size))

    def multiple(self, world_size: int) -> int:
        return 2 * world_size

    def check(self, seq_len: int, world_size: int) -> None:
        want = self.padded_len(world_size)
        if seq_len != want:
            raise ValueError(
                f"DocZigzag over {world_size} ranks holds a padded sequence of {want} tokens "
                f"({want // world_size} per rank); got {seq_len}. Shard the packed tensor with "
                "layout.shard_packed(x, group, dim)"
            )

    def runs(self, seq_len, world_size, rank):
        return [run for start, _, p in self._padded(world_size) for run in zigzag_runs(start, p, world_size, rank)]

    def segments(self, world_size: int) -> tuple[tuple[int, int], ...]:
        """The real tokens of each document in padded positions; the rest is padding."""
        return tuple((start, start + n) for start, n, _ in self._padded(world_size))

    def real_positions(self, world_size: int) -> torch.Tensor:
        """Padded position of each packed token, (sum(doc_lens),) int64."""
        return torch.cat([torch.arange(a, a + n) for a, n, _ in self._padded(world_size)])

    def spec(self) -> str:
        return "doczigzag:" + ",".join(str(n) for n in self.doc_lens)

    # ---- packed <-> padded tensors -------------------------------------------------------------
    def pad(self, x: torch.Tensor, world_size: int, dim: int = 0) -> torch.Tensor:
        """Packed (..., T, ...) -> padded (..., S_padded, ...), zeros in the padding."""
        return sharding.pad_documents(self, x, world_size, dim)

    def shard_packed(self, x: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
        """This rank's shard of the padded sequence, from the full packed tensor."""
        return sharding.shard_packed(self, x, group, dim)

    def loss_mask(self, group: GroupLike = None) -> torch.Tensor:
        """(S_local,) bool: True on this rank's real tokens, False on padding."""
        return sharding.loss_mask(self, group)

    def unshard_packed(self, x_local: torch.Tensor, group: GroupLike = None, dim: int = 0) -> torch.Tensor:
        """The full packed tensor (..., T, ...) from every rank's padded shard (differentiable)."""
        return sharding.unshard_packed(self, x_local, group, dim)
