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
    keep = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device)
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


def exact_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """rel_err, except where the exact answer is zero up to rounding (a query that sees only
    itself has no dq, nor does a one-token document): there ||a - b|| itself, inputs being O(1),
    since a relative error of two roundings of zero means nothing."""
    if b.double().norm() < 1e-12:
        a, b = a.double(), b.double()
        return (a - b).norm().item() if torch.isfinite(a).all() else float("inf")
    return rel_err(a, b)


def window_doc_mask(s, *, is_causal=False, window=(-1, -1), cu_seqlens=None, segments=None):
    """(S, S) bool, True = visible, built densely and independently of dtcp's schedule: flash-attn
    window (left, right) (-1 = unbounded), causal, documents from `cu_seqlens` (global
    boundaries) or `segments` ([start, end) ranges; tokens in none are padding, fully masked)."""
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    keep = torch.ones(s, s, dtype=torch.bool)
    left, right = window
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if is_causal:
        keep &= j <= i
    if cu_seqlens is not None:
        doc = torch.zeros(s, dtype=torch.long)
        for a, b in zip(list(cu_seqlens)[:-1], list(cu_seqlens)[1:]):
            doc[a:b] = a
        keep &= doc[:, None] == doc[None, :]
    if segments is not None:
        doc = torch.full((s,), -1, dtype=torch.long)
        for n, (a, b) in enumerate(segments):
            doc[a:b] = n
        keep &= (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    return keep


def error_messages_of(cases: dict) -> dict:
    """Call each case; map its name to the ValueError/TypeError message it raised, or None."""
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
        else:
            messages[name] = None
    return messages


def assert_each_error_names_its_fix(messages: dict, expected: dict) -> None:
    """Every case of `expected` raised, and its message contains the expected words."""
    for name, needle in expected.items():
        assert messages[name] is not None, f"{name}: no error raised"
        assert needle in messages[name], (name, messages[name])
