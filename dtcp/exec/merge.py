"""Exact merge of partial attention results with the log-sum-exp (online softmax) rule.

If a query row's keys are split into two disjoint sets with partial results (o1, l1) and
(o2, l2), the full result is  l = log(e^l1 + e^l2),  o = o1 e^(l1 - l) + o2 e^(l2 - l).

On CUDA a fused Triton kernel reads each accumulator once and writes it once (the unfused torch
version makes about eight passes over the fp32 output, which at 32K tokens per rank costs a
noticeable fraction of a ring step). `dtcp.config.merge = "torch"` forces the torch version.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import config

try:  # Triton is optional: CPU-only installs don't have it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


#: a launch whose rows lie apart (in order, in a window) in more than this many ranges merges (adds)
#: once over the window with a row mask; in fewer, range by range (a window can be the rank's whole
#: length: fewer ranges move less memory range by range)
MASKED_RANGES = 4


def merge_into_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
                rows_used: Optional[torch.Tensor] = None, out_src: Optional[torch.Tensor] = None) -> None:
    """In place: fold one block's (out_blk, lse_blk) into the running (out_acc, lse_acc).

    out_acc: (B, H, L, D) float32/float64, lse_acc: (B, H, L) same dtype (-inf where no key yet).
    out_blk: (B, H, L, D) any float dtype, lse_blk: (B, H, L). Rows where both are -inf stay
    (0, -inf) instead of turning into NaN. rows_used: (L,) bool or None; where False the
    accumulators stay as they are and the block's values there are not used (any value, NaN
    included: a kernel's rows left unwritten).

    out_src: the running output to read, shaped like out_acc, when it is not out_acc itself (then
    out_acc is only written); either may then be in the inputs' dtype (bf16, fp16): the merge reads
    it into lse_acc's dtype, computes there and rounds once where it writes. So a merge from a
    bf16 result into a float32 accumulator, or from one back into the result, gives the bits of a
    float32 copy of the result merged in place and cast back (exec/fused.py routes rows so).
    """
    if config.merge == "triton" and triton is None:
        raise RuntimeError("dtcp.config.merge='triton' but triton is not installed; use 'auto' or 'torch'")
    src = out_acc if out_src is None else out_src
    if _use_triton(out_acc, lse_acc, out_blk, lse_blk, src):
        _merge_triton(out_acc, lse_acc, out_blk, lse_blk, rows_used, src)
    else:
        _merge_torch(out_acc, lse_acc, out_blk, lse_blk, rows_used, src)


def _merge_torch(out_acc, lse_acc, out_blk, lse_blk, rows_used=None, out_src=None):
    src = out_acc if out_src is None else out_src
    if rows_used is not None:  # unused rows: no keys (lse -inf), value 0 (not NaN * 0)
        lse_blk = torch.where(rows_used, lse_blk, float("-inf"))
        out_blk = torch.where(rows_used.unsqueeze(-1), out_blk, 0)
    lse_blk = lse_blk.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).unsqueeze(-1)
    if src is out_acc and out_acc.dtype == lse_acc.dtype:
        out_acc.mul_(w_old).add_(out_blk.to(out_acc.dtype) * w_blk)
    else:  # the same operations on the source read into lse_acc's dtype, written once
        new = src.to(lse_acc.dtype, copy=True).mul_(w_old).add_(out_blk.to(lse_acc.dtype) * w_blk)
        if rows_used is not None:  # rows left out are not written
            new = torch.where(rows_used.unsqueeze(-1), new, out_acc.to(lse_acc.dtype))
        out_acc.copy_(new)
    lse_acc.copy_(new_lse)


def _use_triton(out_acc, lse_acc, out_blk, lse_blk, out_src=None) -> bool:
    src = out_acc if out_src is None else out_src
    return (
        triton is not None
        and out_acc.is_cuda
        and lse_acc.dtype == torch.float32
        and all(x.dtype in (torch.float32, torch.bfloat16, torch.float16) for x in (out_acc, src))
        and out_acc.stride(-1) == 1
        and src.stride(-1) == 1
        and out_blk.stride(-1) == 1
        and out_acc.shape[-1] <= 256
        and config.merge != "torch"
    )


if triton is not None:

    @triton.jit
    def _lse_weights(lse_old, lse_blk):
        """Per row (float32): the running result's and the block's weights in the merged result,
        and the merged lse; rows where both lse are -inf get weights 0 and lse -inf."""
        m = tl.maximum(lse_old, lse_blk)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_old = tl.exp(lse_old - m)
        w_blk = tl.exp(lse_blk - m)
        total = w_old + w_blk
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        return w_old * inv, w_blk * inv, m + tl.log(total)

    @triton.jit
    def _tile(H, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's (batch row, head, rows, cols) of a (B * H, cdiv(L, BLOCK_L)) grid."""
        bh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        return bh // H, bh % H, rows, tl.arange(0, BLOCK_D)

    @triton.jit
    def _row_weights(lse_ptr, blk_lse_ptr, b, h, rows, active, sl_b, sl_h, sl_l, sbl_b, sbl_h, sbl_l):
        """_lse_weights of the `active` rows' running and block lse (others read as -inf)."""
        lse_old = tl.load(lse_ptr + b * sl_b + h * sl_h + rows * sl_l, mask=active, other=float("-inf"))
        lse_blk = tl.load(blk_lse_ptr + b * sbl_b + h * sbl_h + rows * sbl_l, mask=active,
                          other=float("-inf")).to(tl.float32)
        return _lse_weights(lse_old, lse_blk)

    @triton.jit
    def _merge_kernel(
        out_ptr, lse_ptr, blk_ptr, blk_lse_ptr, src_ptr,
        H, L, D,
        so_b, so_h, so_l, ss_b, ss_h, ss_l, sl_b, sl_h, sl_l,
        sb_b, sb_h, sb_l, sbl_b, sbl_h, sbl_l, used_ptr,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, HAS_USED: tl.constexpr,
    ):
        b, h, rows, cols = _tile(H, BLOCK_L, BLOCK_D)
        rmask = rows < L
        if HAS_USED:  # rows left out are neither read nor written
            rmask = rmask & (tl.load(used_ptr + rows, mask=rmask, other=0) != 0)
        mask = rmask[:, None] & (cols[None, :] < D)

        w_old, w_blk, new_lse = _row_weights(lse_ptr, blk_lse_ptr, b, h, rows, rmask,
                                             sl_b, sl_h, sl_l, sbl_b, sbl_h, sbl_l)

        o_ptrs = out_ptr + b * so_b + h * so_h + rows[:, None] * so_l + cols[None, :]
        s_ptrs = src_ptr + b * ss_b + h * ss_h + rows[:, None] * ss_l + cols[None, :]
        b_ptrs = blk_ptr + b * sb_b + h * sb_h + rows[:, None] * sb_l + cols[None, :]
        o = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        # One explicit fma: the compiler would otherwise contract o * a + ob * b either way
        # depending on the source's dtype, and a bf16 source must give a float32 one's bits.
        o = tl.fma(o, w_old[:, None], ob * w_blk[:, None])
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + b * sl_b + h * sl_h + rows * sl_l, new_lse, mask=rmask)

    def _merge_triton(out_acc, lse_acc, out_blk, lse_blk, rows_used=None, out_src=None):
        src = out_acc if out_src is None else out_src
        bsz, h, l, d = out_acc.shape
        block_d = triton.next_power_of_2(d)
        block_l = max(1, 4096 // block_d)
        grid = (bsz * h, triton.cdiv(l, block_l))
        _merge_kernel[grid](
            out_acc, lse_acc, out_blk, lse_blk, src, h, l, d,
            out_acc.stride(0), out_acc.stride(1), out_acc.stride(2),
            src.stride(0), src.stride(1), src.stride(2),
            lse_acc.stride(0), lse_acc.stride(1), lse_acc.stride(2),
            out_blk.stride(0), out_blk.stride(1), out_blk.stride(2),
            lse_blk.stride(0), lse_blk.stride(1), lse_blk.stride(2),
            lse_acc if rows_used is None else rows_used.view(torch.uint8),  # (any pointer when unused)
            BLOCK_L=block_l, BLOCK_D=block_d, HAS_USED=rows_used is not None, num_warps=4,
        )


def apply_sink_(out_acc: torch.Tensor, lse_acc: torch.Tensor, sink: torch.Tensor) -> None:
    """In place: add, once per row, a sink column (logit sink[h], no value) to merged results:
    lse' = log(e^lse + e^sink[h]), out' = out * e^(lse - lse'). Rows that see no key at all
    (lse = -inf: document padding) stay (0, -inf).

    out_acc: (B, H, L, Dv) float32/float64, lse_acc: (B, H, L) same dtype, sink: (H,)."""
    s = sink.to(lse_acc.dtype)[None, :, None]
    seen = torch.isfinite(lse_acc)
    new_lse = torch.where(seen, torch.logaddexp(lse_acc, s), lse_acc)
    weight = torch.where(seen, torch.exp(lse_acc - new_lse), torch.ones_like(lse_acc))
    out_acc.mul_(weight.unsqueeze(-1))
    lse_acc.copy_(new_lse)


# ---- routed rows in one launch (exec/fused.py Landing) ---------------------------------------------------
#: a row's role in a launch (plan/fuse.py ONLY, FIRST, MID, LAST), and NONE for a row of the launch's
#: window that is not its own (neither read nor written)
NONE_ROLE = 4


def can_land_in_one_launch(*tensors: torch.Tensor) -> bool:
    """Can land_merge_ / land_add_ run as one Triton launch on these (CUDA, float32 or half
    types, the last dim contiguous)?"""
    return (triton is not None and config.merge != "torch" and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)
            and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors))


def land_merge_(acc: torch.Tensor, result: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor,
                lse_blk: torch.Tensor, roles: torch.Tensor) -> None:
    """merge_into_ over a launch's window with each row's role (`roles`, (L,) int8 on the device:
    ONLY reads and writes `result`, FIRST reads it and writes `acc`, MID `acc` to `acc`, LAST
    `acc` to `result`, NONE_ROLE neither), in one launch: the bits of merge_into_ run role by role.
    acc, result, out_blk: (B, H, L, D); lse (float32), lse_blk: (B, H, L)."""
    bsz, h, l, d = acc.shape
    block_d = triton.next_power_of_2(d)
    block_l = max(1, 4096 // block_d)
    _land_merge_kernel[(bsz * h, triton.cdiv(l, block_l))](
        acc, result, lse, out_blk, lse_blk, roles, h, l, d,
        acc.stride(0), acc.stride(1), acc.stride(2), result.stride(0), result.stride(1), result.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), out_blk.stride(0), out_blk.stride(1), out_blk.stride(2),
        lse_blk.stride(0), lse_blk.stride(1), lse_blk.stride(2),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
    )


def land_add_(acc: torch.Tensor, result: torch.Tensor, grad: torch.Tensor, roles: torch.Tensor) -> None:
    """The backward's dQ add over a launch's window by role, in one launch (rows form, (L, H, D)
    each): ONLY result += grad (rounded once), FIRST acc = result + grad, MID acc += grad, LAST
    result = acc + grad (rounded once); NONE_ROLE rows (grad undefined there) untouched. The bits
    of exec/fused.py add_runs_'s tensor ops."""
    l, h, d = acc.shape
    block_d = triton.next_power_of_2(d)
    block_l = max(1, 4096 // block_d)
    _land_add_kernel[(h, triton.cdiv(l, block_l))](
        acc, result, grad, roles, l, d,
        acc.stride(0), acc.stride(1), result.stride(0), result.stride(1), grad.stride(0), grad.stride(1),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _land_merge_kernel(
        acc_ptr, res_ptr, lse_ptr, blk_ptr, blk_lse_ptr, role_ptr,
        H, L, D,
        sa_b, sa_h, sa_l, sr_b, sr_h, sr_l, sl_b, sl_h, sl_l, sb_b, sb_h, sb_l, sbl_b, sbl_h, sbl_l,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b, h, rows, cols = _tile(H, BLOCK_L, BLOCK_D)
        role = tl.load(role_ptr + rows, mask=rows < L, other=4)
        act = (rows < L) & (role < 4)
        from_res = (role == 0) | (role == 1)
        to_res = (role == 0) | (role == 3)
        cmask = cols[None, :] < D
        mask = act[:, None] & cmask

        w_old, w_blk, new_lse = _row_weights(lse_ptr, blk_lse_ptr, b, h, rows, act,
                                             sl_b, sl_h, sl_l, sbl_b, sbl_h, sbl_l)

        a_ptrs = acc_ptr + b * sa_b + h * sa_h + rows[:, None] * sa_l + cols[None, :]
        r_ptrs = res_ptr + b * sr_b + h * sr_h + rows[:, None] * sr_l + cols[None, :]
        b_ptrs = blk_ptr + b * sb_b + h * sb_h + rows[:, None] * sb_l + cols[None, :]
        o_res = tl.load(r_ptrs, mask=mask & from_res[:, None], other=0.0).to(tl.float32)
        o_acc = tl.load(a_ptrs, mask=mask & (from_res == 0)[:, None], other=0.0).to(tl.float32)
        o = tl.where(from_res[:, None], o_res, o_acc)
        ob = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        o = tl.fma(o, w_old[:, None], ob * w_blk[:, None])  # (as _merge_kernel)
        tl.store(r_ptrs, o.to(res_ptr.dtype.element_ty), mask=mask & to_res[:, None])
        tl.store(a_ptrs, o.to(acc_ptr.dtype.element_ty), mask=mask & (to_res == 0)[:, None])
        tl.store(lse_ptr + b * sl_b + h * sl_h + rows * sl_l, new_lse, mask=act)

    @triton.jit
    def _land_add_kernel(
        acc_ptr, res_ptr, g_ptr, role_ptr,
        L, D,
        sa_l, sa_h, sr_l, sr_h, sg_l, sg_h,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        h = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        role = tl.load(role_ptr + rows, mask=rows < L, other=4)
        act = (rows < L) & (role < 4)
        from_res = (role == 0) | (role == 1)
        to_res = (role == 0) | (role == 3)
        mask = act[:, None] & (cols[None, :] < D)
        a_ptrs = acc_ptr + h * sa_h + rows[:, None] * sa_l + cols[None, :]
        r_ptrs = res_ptr + h * sr_h + rows[:, None] * sr_l + cols[None, :]
        g_ptrs = g_ptr + h * sg_h + rows[:, None] * sg_l + cols[None, :]
        x_res = tl.load(r_ptrs, mask=mask & from_res[:, None], other=0.0).to(tl.float32)
        x_acc = tl.load(a_ptrs, mask=mask & (from_res == 0)[:, None], other=0.0).to(tl.float32)
        y = tl.where(from_res[:, None], x_res, x_acc) + tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptrs, y.to(res_ptr.dtype.element_ty), mask=mask & to_res[:, None])
        tl.store(a_ptrs, y.to(acc_ptr.dtype.element_ty), mask=mask & (to_res == 0)[:, None])


# ---- later launches kept whole, merged once (exec/fused.py Slots) ----------------------------------------
def merge_slots_(out: torch.Tensor, lse: torch.Tensor, slot_out: torch.Tensor, slot_lse: torch.Tensor,
                 spans: tuple, table: Optional[torch.Tensor]) -> None:
    """In place: fold every kept launch's (out, lse) into the results its pass's first launch
    wrote, in one pass over them (exec/fused.py Slots).

    out: (B, H, L, Dv) in the inputs' dtype, lse: (B, H, L) float32 (float64 for float64), both
    the first launch's. slot_out: (B, R, H, Dv) and slot_lse: (B * H * R,) as the kept launches
    wrote them: a launch whose output has T rows wrote rows base..base + T of slot_out and the
    (B, H, T) block at B * H * base of slot_lse. `spans`: (a, e, o, base, T) per range of a
    launch's query rows, in launch order: its rows [a, e) are slot rows o.. (o - base.. of the
    launch's output: a launch whose rows lie apart has one span per range). `table`: the spans as
    a (C, 5) int32 tensor on the device (the Triton kernel's), or None. Each row's parts merge in float32 and its output is
    rounded once: no float32 accumulator is read or written between launches. Only the rows
    between the first kept row and the last are read and written (the rest keep the first
    launch's results as they are)."""
    lo, hi = _hull(spans)
    if hi <= lo:
        return
    if table is not None and _slots_on_triton(out, lse, slot_out):
        bsz, h, _, d = out.shape
        block_d = triton.next_power_of_2(d)
        block_l = max(1, 4096 // block_d)
        _merge_slots_kernel[(bsz * h, triton.cdiv(hi - lo, block_l))](
            out, lse, slot_out, slot_lse, table, len(spans), bsz, h, lo, hi, d,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
            slot_out.stride(0), slot_out.stride(1), slot_out.stride(2),
            BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
        )
        return
    # The torch merge launch by launch, in launch order, per batch row, on views shaped as exec/fused.py
    # merge_launch_'s (a float32 accumulator over every row): elementwise exp and log then run the
    # same loops (the vector body and its scalar tail), so both give the same bits on any CPU.
    # A launch whose rows lie apart in more than MASKED_RANGES ranges merges once over its window
    # with a row mask, as exec/fused.py merge_launch_ merges it; else range by range.
    bsz, h = out.shape[:2]
    run_out, run_lse = out.to(lse.dtype), lse.clone()
    for b in range(bsz):
        for base, t, launch in _by_launch(spans):
            block_out = slot_out[b, base:base + t].transpose(0, 1).unsqueeze(0)
            block_lse = slot_lse[bsz * h * base:bsz * h * (base + t)].view(bsz, h, t)[b].unsqueeze(0)
            if len(launch) > MASKED_RANGES:
                w0 = launch[0][0] - (launch[0][2] - base)
                used = torch.zeros(t, dtype=torch.bool, device=out.device)
                for a, e, o, _, _ in launch:
                    used[o - base:o - base + e - a] = True
                _merge_torch(run_out[b:b + 1, :, w0:w0 + t], run_lse[b:b + 1, :, w0:w0 + t], block_out, block_lse,
                             used)
                continue
            for a, e, o, _, _ in launch:
                c = o - base
                _merge_torch(run_out[b:b + 1, :, a:e], run_lse[b:b + 1, :, a:e], block_out[:, :, c:c + e - a],
                             block_lse[:, :, c:c + e - a])
    out[:, :, lo:hi].copy_(run_out[:, :, lo:hi])
    lse[:, :, lo:hi].copy_(run_lse[:, :, lo:hi])


def sum_slots_(grad: torch.Tensor, slots: torch.Tensor, spans: tuple, table: Optional[torch.Tensor],
               acc: torch.dtype) -> None:
    """In place: grad (B, H, L, D), which the pass's first launch wrote, plus every kept launch's
    gradient rows (slots (B, R, H, D): the rows [a, e) of each span (a, e, o, ...) at slot rows
    o.., as in merge_slots_), summed in `acc` (float32; float64 for float64) and rounded once.
    `table` as in merge_slots_; only the rows between the first kept row and the last are read
    and written."""
    lo, hi = _hull(spans)
    if hi <= lo:
        return
    if table is not None and _slots_on_triton(grad, slots):
        bsz, h, _, d = grad.shape
        block_d = triton.next_power_of_2(d)
        block_l = max(1, 4096 // block_d)
        _sum_slots_kernel[(bsz * h, triton.cdiv(hi - lo, block_l))](
            grad, slots, table, len(spans), h, lo, hi, d,
            grad.stride(0), grad.stride(1), grad.stride(2), slots.stride(0), slots.stride(1), slots.stride(2),
            BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
        )
        return
    total = grad[:, :, lo:hi].to(acc)
    for a, e, o, _, _ in spans:
        total[:, :, a - lo:e - lo].add_(slots[:, o:o + e - a].transpose(1, 2))
    grad[:, :, lo:hi].copy_(total)


def _by_launch(spans):
    """(base, T, its spans) of each kept launch, in launch order (a launch's spans share its base)."""
    group: list = []
    for span in spans:
        if group and span[3] != group[0][3]:
            yield group[0][3], group[0][4], group
            group = []
        group.append(span)
    if group:
        yield group[0][3], group[0][4], group


def _hull(spans) -> tuple[int, int]:
    """The rows from the first kept launch's first row to the last one's last: (0, 0) for none."""
    return (min(span[0] for span in spans), max(span[1] for span in spans)) if spans else (0, 0)


def _slots_on_triton(*tensors: torch.Tensor) -> bool:
    """can_land_in_one_launch, with a head dim one tile holds (as _use_triton)."""
    return can_land_in_one_launch(*tensors) and tensors[0].shape[-1] <= 256


if triton is not None:

    @triton.jit
    def _merge_slots_kernel(
        out_ptr, lse_ptr, so_ptr, sl_ptr, table_ptr, C, B, H, LO, HI, D,
        so_b, so_h, so_l, sl_b, sl_h, sl_l, sso_b, sso_r, sso_h,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b, h, rows, cols = _tile(H, BLOCK_L, BLOCK_D)
        rows += LO  # (the rows [LO, HI) the kept launches reach)
        rmask = rows < HI
        cmask = cols[None, :] < D
        mask = rmask[:, None] & cmask
        l_ptrs = lse_ptr + b * sl_b + h * sl_h + rows * sl_l
        o_ptrs = out_ptr + b * so_b + h * so_h + rows[:, None] * so_l + cols[None, :]
        # Online over the parts: m the largest lse so far, s the sum of exp(lse_i - m), acc the
        # sum of exp(lse_i - m) * o_i. A part without keys (lse -inf) weighs 0, its values unread.
        m = tl.load(l_ptrs, mask=rmask, other=float("-inf"))
        s = tl.where(m == float("-inf"), 0.0, 1.0)
        acc = tl.where(s[:, None] > 0, tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32), 0.0)
        for c in range(C):
            a = tl.load(table_ptr + 5 * c)
            e = tl.load(table_ptr + 5 * c + 1)
            off = tl.load(table_ptr + 5 * c + 2)
            base = tl.load(table_ptr + 5 * c + 3)
            t = tl.load(table_ptr + 5 * c + 4)
            act = rmask & (rows >= a) & (rows < e)
            # (the launch's (B, H, T) lse block at B * H * base; these rows at its columns off - base..)
            lc = tl.load(sl_ptr + (B * base + b * t) * H + h * t + (off - base) + (rows - a), mask=act,
                         other=float("-inf")).to(tl.float32)
            oc = tl.load(so_ptr + b * sso_b + (off + rows - a)[:, None] * sso_r + h * sso_h + cols[None, :],
                         mask=act[:, None] & cmask, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, lc)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            beta = tl.exp(lc - m_ref)
            acc = acc * alpha[:, None] + tl.where(beta[:, None] > 0, oc * beta[:, None], 0.0)
            s = s * alpha + beta
            m = m_new
        inv = tl.where(s > 0, 1.0 / s, 0.0)
        tl.store(o_ptrs, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        tl.store(l_ptrs, tl.where(s > 0, m_ref + tl.log(s), float("-inf")), mask=rmask)

    @triton.jit
    def _sum_slots_kernel(
        g_ptr, s_ptr, table_ptr, C, H, LO, HI, D,
        sg_b, sg_h, sg_l, ss_b, ss_r, ss_h,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b, h, rows, cols = _tile(H, BLOCK_L, BLOCK_D)
        rows += LO  # (the rows [LO, HI) the kept launches reach)
        rmask = rows < HI
        cmask = cols[None, :] < D
        g_ptrs = g_ptr + b * sg_b + h * sg_h + rows[:, None] * sg_l + cols[None, :]
        total = tl.load(g_ptrs, mask=rmask[:, None] & cmask, other=0.0).to(tl.float32)
        for c in range(C):
            a = tl.load(table_ptr + 5 * c)
            e = tl.load(table_ptr + 5 * c + 1)
            off = tl.load(table_ptr + 5 * c + 2)
            act = rmask & (rows >= a) & (rows < e)
            total += tl.load(s_ptr + b * ss_b + (off + rows - a)[:, None] * ss_r + h * ss_h + cols[None, :],
                             mask=act[:, None] & cmask, other=0.0).to(tl.float32)
        tl.store(g_ptrs, total.to(g_ptr.dtype.element_ty), mask=rmask[:, None] & cmask)
