"""Single-process reference attention and comparison helpers shared by the tests."""

from __future__ import annotations

import math
from typing import Optional

import torch


def reference_attention(q, k, v, *, is_causal=False, scale=None, mask: Optional[torch.Tensor] = None):
    """Plain softmax attention in float64 on full tensors (B, H, S, D), GQA by head repetition.

    `mask` (S, S) bool, True = visible, combines with `is_causal`. Returns out (B, Hq, S, D) and
    lse (B, Hq, S), both differentiable. Fully masked rows give out 0 and lse -inf.
    """
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    keep = torch.ones(s, k.shape[2], dtype=torch.bool)
    if is_causal:
        keep &= torch.ones_like(keep).tril()
    if mask is not None:
        keep &= mask
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v.double(), lse


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64, over finite entries of b (and a must be finite there too)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
