"""Exact merge of partial attention results with the log-sum-exp (online softmax) rule.

If a query row's keys are split into two disjoint sets with partial results (o1, l1) and
(o2, l2), the full result is  l = log(e^l1 + e^l2),  o = o1 e^(l1 - l) + o2 e^(l2 - l).
"""

from __future__ import annotations

import torch


def merge_into_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: fold one block's (out_blk, lse_blk) into the running (out_acc, lse_acc).

    out_acc: (B, H, L, D) float32/float64, lse_acc: (B, H, L) same dtype (-inf where no key yet).
    out_blk: (B, H, L, D) any float dtype, lse_blk: (B, H, L). Rows where both are -inf stay
    (0, -inf) instead of turning into NaN.
    """
    lse_blk = lse_blk.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).unsqueeze(-1)
    out_acc.mul_(w_old).add_(out_blk.to(out_acc.dtype) * w_blk)
    lse_acc.copy_(new_lse)
