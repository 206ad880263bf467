"""FlashAttention-4 (the flash-attn-4 package, module flash_attn.cute: CuTe DSL kernels compiled on
first use), when installed (`pip install "dtcp[flash]"`): Hopper and Blackwell, fp16/bf16, GQA
without repeating K/V, bottom-right aligned windows, softcap, attention sinks, a value head dim of
its own, varlen in one launch.

dtcp calls FA4's low-level pair in flash_attn/cute/interface.py (checked on flash-attn-4 4.0.0b36):

    _flash_attn_fwd(q, k, v, ..., softmax_scale, causal, softcap, window_size_left,
                    window_size_right, learnable_sink, return_lse=True) -> (out, lse, ...)
    _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                    window_size_right, ...) -> (dq, dk, dv)

q/k/v/out/dout are (B, L, H, D) (varlen: (T, H, D) with int32 cu_seqlens); lse is float32
(B, H, L) (varlen: (H, T)), natural log, including the sink. The backward takes out and lse from
outside, so dtcp passes the merged (global) ones and gets this block's share of the gradient; it
uses the sink only through that lse (FA4 would add a sink gradient only if given the sink, and dtcp
computes that gradient itself). dq/dk/dv come back in the input dtype (FA4 accumulates in fp32 and
converts); dk/dv with the K/V head count.

Masks. FA4's window (left, right) keeps key `col` for query `row` iff
    row + (k_len - q_len) - left <= col <= row + (k_len - q_len) + right
(None = unbounded, `causal` = (None, 0)). FA4 reads two negative bounds as "unbounded", and its
block ranges have no branch for a query tile that sees no key (the forward then visits one block
before key 0; on H200, 4.0.0b36's forward still gave such rows out 0 and lse -inf:
benchmarks/check_kernels.py --fa4-untrimmed). `fa4_call` keeps FA4 away from all of that: it runs
each band-masked block on the rows that see a key and the keys some row sees, where both bounds are
>= 0, row 0 sees key 0 and the last row the last key (exact by construction; a strictly-lower band
(None, -1) becomes FA4's causal kernel). The rows left out get out 0 and lse -inf (the sink, with a
sink); the keys left out get dK = dV = 0. Varlen calls cannot be cut so; sequences whose first rows
see no key are refused there (the per-task schedule serves them; flash refuses them too).

Head dims: on Hopper, FA4 4.0.0b36's backward returns a wrong dq (and GQA dk/dv) for head dims
<= 128 that round up to an odd number of 16s (16, 48, 80, 112: measured on H200), so those are
refused there (`_head_dims_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional

import torch

from .base import (Kernel, Target, VarlenSeqs, device_type, keyed_block, keyless_sequence, landed, no_key_rows,
                   seq_slice)
from .replay import Replayed, fa4_cache_owners

INSTALL_HINT = 'pip install "dtcp[flash]"'

# The import of flash_attn.cute, tried once per process on first use on a CUDA tensor: None =
# not tried yet; else (interface module or None, None or why it is unavailable).
_IMPORT: Optional[tuple] = None


def fa4_interface():
    """(flash_attn.cute.interface, None), or (None, why FA4 cannot be used). Imported lazily and
    once: importing dtcp never imports FA4 (whose import loads the CUDA toolchain of the CuTe DSL)."""
    global _IMPORT
    if _IMPORT is None:
        try:
            from flash_attn.cute import interface  # optional third-party package
        except ModuleNotFoundError as e:
            _IMPORT = (None, f"fa4 needs FlashAttention-4 (module flash_attn.cute), which is not installed "
                             f"({e}): {INSTALL_HINT}")
        except Exception as e:  # noqa: BLE001 - a broken install (CUDA libraries, cutlass) is a reason, not a crash
            _IMPORT = (None, f"fa4 needs FlashAttention-4 (module flash_attn.cute), which is installed but failed "
                             f"to import ({type(e).__name__}: {e}); reinstall it with {INSTALL_HINT}")
        else:
            missing = [f for f in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(interface, f)]
            _IMPORT = ((None, f"fa4 needs flash_attn.cute.interface.{missing[0]}, which this flash-attn-4 lacks "
                              f"(checked on 4.0.0b36): {INSTALL_HINT}") if missing else (interface, None))
    return _IMPORT


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself where it is already (a dtype check in Python instead of a
    dispatched no-op .to(): seven a launch pair, host time on a host-bound ring)."""
    return t if t.dtype == dtype else t.to(dtype)


def _interface():
    module, why = fa4_interface()
    if module is None:
        raise RuntimeError(why)
    return module


# FA4's _flash_attn_fwd / _flash_attn_bwd, each run through its Python on a call signature's first
# two calls (the second recorded) and replayed after (dtcp/kernels/replay.py;
# dtcp.config.kernel_replay), where its release was read for
# what a replay relies on: every launch taken out of a compile cache at the call
# (`f.compile_cache[key](...)` in flash_attn/cute/interface.py), and no tensor value read on the
# host where the dispatcher does not see it (.tolist(), .numpy(): the interface has neither).
REPLAY_CHECKED = ("4.0.0b36",)
_REPLAYED: dict = {}


def _release() -> Optional[str]:
    try:
        from importlib.metadata import version
        return version("flash-attn-4")
    except Exception:  # noqa: BLE001 - not installed as that distribution: not a checked release
        return None


def replayed(name: str) -> Replayed:
    """FA4's `_flash_attn_{name}` ("fwd" or "bwd") as a Replayed wrapper (its stats say how the
    calls went); it calls the function every time where the release is not in REPLAY_CHECKED."""
    module = _interface()
    got = _REPLAYED.get(name)
    if got is None or got[0] is not module:
        wrapper = Replayed(getattr(module, f"_flash_attn_{name}"), fa4_cache_owners(module), f"fa4 {name}",
                           enabled=_release() in REPLAY_CHECKED)
        got = _REPLAYED[name] = (module, wrapper)
    return got[1]


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(q: torch.Tensor) -> int:
    return q.device.index if q.device.index is not None else torch.cuda.current_device()


def _capability_of(q: torch.Tensor, target: Optional[Target]) -> tuple[int, int]:
    """q's GPU's compute capability, or the assumed target's (no device queried)."""
    return _capability(_index(q)) if target is None else target.capability


def _major(q: torch.Tensor, target: Optional[Target] = None) -> int:
    return _capability_of(q, target)[0]


def _head_dims_reason(d: int, dv: int, major: int) -> Optional[str]:
    """Why FA4 on compute capability `major`.x has no forward+backward for head dims (d, dv), or
    None (flash_attn/cute/interface.py: _validate_head_dims and the backward's tile configs)."""
    if d % 8 or dv % 8 or min(d, dv) < 8:
        return f"fa4 needs head dims that are multiples of 8 and >= 8; got q/k {d}, v {dv}"
    if major == 9:
        if max(d, dv) > 256:
            return f"fa4 on compute capability 9.x takes head dims up to 256; got q/k {d}, v {dv}"
        odd = [x for x in (d, dv) if x <= 128 and (x + 15) // 16 % 2]
        if odd:
            # flash_bwd_sm90.py rounds its dQ (and GQA dK/dV) fp32 accumulator rows to 16 columns,
            # interface.py and the postprocess read them rounded to 32: dq came back wrong (relative
            # error ~0.9) for head dims 16, 48, 80, 112 on H200 with flash-attn-4 4.0.0b36, right
            # for 24, 32, 64, 96, 128, 160, 256.
            return (f"fa4 on compute capability 9.x gives wrong gradients for head dim {odd[0]} (FA4's Hopper "
                    "backward needs head dims <= 128 to round up to an even number of 16s: 24, 32, 56, 64, 88, "
                    "96, 120, 128 work; 16, 48, 80, 112 do not): use backend='cudnn' or 'flash'")
        if d != dv and (d, dv) != (192, 128):
            return (f"fa4 takes a v head dim different from q/k's only as (192, 128) (DeepSeek's, which FA4 has "
                    f"tiles for); got ({d}, {dv}): use backend='math' or equal head dims")
        return None
    if major in (10, 11):
        if (d <= 128 and dv <= 128) or (d, dv) in ((192, 128), (256, 256)):
            return None
        return (f"fa4 on compute capability {major}.x takes head dims up to 128, (192, 128) or (256, 256); "
                f"got ({d}, {dv})")
    if major == 12:
        if d == dv and d <= 128:
            return None
        return f"fa4 on compute capability 12.x takes equal q/k and v head dims up to 128 in dtcp; got ({d}, {dv})"
    return f"fa4 in dtcp knows compute capabilities 9.x to 12.x; got {major}.x"


def _device_reason(q: torch.Tensor, target: Optional[Target] = None) -> Optional[str]:
    """Device, dtype, installation and compute capability: why FA4 cannot run on q's device (or
    on an assumed `target`, where FA4 counts as installed and is not imported)."""
    if device_type(q, target) != "cuda":
        return f"fa4 needs CUDA tensors; got {device_type(q, target)}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fa4 takes float16/bfloat16; got {q.dtype}"
    major, minor = _capability_of(q, target)
    if major < 9:
        return (f"fa4 needs compute capability >= 9.0 (FA4 has no backward before Hopper); got {major}.{minor}: "
                "use backend='flash' or 'cudnn'")
    if target is not None:
        return None
    _, why = fa4_interface()
    return why


# ---- masks: dtcp's band on a block -> one FA4 call ------------------------------------------------------
@dataclass(frozen=True)
class Fa4Call:
    """One band-masked q_len x k_len block as one FA4 call: query rows r0:r1 (those that see at
    least one key) and keys c0:c1 (those some row sees) under FA4's bottom-right window (left,
    right), None = unbounded; both are >= 0 when set. `empty` when no row sees any key."""

    r0: int
    r1: int
    c0: int
    c1: int
    left: Optional[int]
    right: Optional[int]

    @property
    def empty(self) -> bool:
        return self.r1 <= self.r0

    @property
    def causal(self) -> bool:
        """FA4's causal mask (what it makes of the window (None, 0) too)."""
        return self.left is None and self.right == 0

    def whole(self, q_len: int, k_len: int) -> bool:
        """The call covers the whole block (no rows or keys left out)."""
        return (self.r0, self.r1, self.c0, self.c1) == (0, q_len, 0, k_len)

    def window_args(self) -> dict:
        if self.causal:
            return dict(causal=True, window_size_left=None, window_size_right=None)
        return dict(causal=False, window_size_left=self.left, window_size_right=self.right)


def fa4_call(q_len: int, k_len: int, lo: Optional[int], hi: Optional[int]) -> Fa4Call:
    """The FA4 call that computes band (lo, hi) (key j visible from query i iff lo <= j - i <= hi,
    None = unbounded) on a q_len x k_len block: exact, see the module docstring."""
    kb = keyed_block(q_len, k_len, lo, hi)
    if kb.empty:
        return Fa4Call(0, 0, 0, 0, None, None)
    sq, sk = kb.r1 - kb.r0, kb.c1 - kb.c0
    left, right = kb.band.aligned_window(sq, sk)  # the inverse of Band.from_aligned_window; -1 = unbounded
    call = Fa4Call(kb.r0, kb.r1, kb.c0, kb.c1, None if kb.band.lo is None else left,
                   None if kb.band.hi is None else right)
    # Row 0 sees key 0 and the last row the last key, so a bounded side is never negative (FA4
    # reads a negative bound literally, and two negative ones as "unbounded").
    assert (call.left is None or call.left >= 0) and (call.right is None or call.right >= 0), \
        (call, q_len, k_len, lo, hi)
    return call


def fa4_varlen_window(window: tuple[int, int]) -> dict:
    """FA4's arguments for dtcp's varlen window (left, right), bottom-right aligned, -1 (any
    negative: Band.from_aligned_window's reading) = unbounded."""
    left, right = (None if w < 0 else w for w in window)
    if left is None and right == 0:
        return dict(causal=True, window_size_left=None, window_size_right=None)
    return dict(causal=False, window_size_left=left, window_size_right=right)


def fa4_varlen_reason(seq_lens: Iterable[tuple[int, int]], window: tuple[int, int]) -> Optional[str]:
    """Why one FA4 varlen call with this bottom-right window is not known to be exact on these
    sequences, or None: every row of a sequence must see a key (see the module docstring)."""
    bad = keyless_sequence(seq_lens, window)
    if bad is not None:
        return (f"fa4 takes no varlen sequence whose first rows see no key (a {bad[0]}x{bad[1]} sequence under the "
                f"bottom-right window {tuple(window)}): use backend='auto', which takes another kernel")
    return None


class Fa4Kernel(Kernel):
    """FlashAttention-4 (flash_attn.cute): fp16/bf16 on compute capability >= 9.0, any band, GQA,
    softcap, sinks, (192, 128) head dims, varlen in one launch."""

    name = "fa4"
    supports_varlen = True
    varlen_one_launch = True  # _flash_attn_fwd/_bwd with cu_seqlens
    varlen_gaps = True  # ... and seqused_q / seqused_k (tests/gpu/test_one_gpu_ranks.py checks them)
    takes_softcap = True
    takes_sinks = True
    takes_value_head_dim = True

    # ---- what it refuses --------------------------------------------------------------------------------
    def feature_reason(self, q, v, softcap, sinks, target=None):
        why = super().feature_reason(q, v, softcap, sinks) or _device_reason(q, target)
        if why is not None:
            return why
        major, d = _major(q, target), q.shape[-1]
        dv = d if v is None else v.shape[-1]
        why = _head_dims_reason(d, dv, major)
        if why is not None:
            return why
        if v is not None and d != dv and q.shape[1] != v.shape[1] and major == 9:
            # flash_bwd_sm90.py: assert self.same_hdim_kv, "GQA backward requires head_dim == head_dim_v"
            return (f"fa4 on compute capability 9.x has no backward for GQA ({q.shape[1]} q heads, {v.shape[1]} kv "
                    f"heads) with a v head dim ({dv}) different from q/k's ({d}): use equal head counts or "
                    "backend='math'")
        if softcap is not None and (major == 12 or (major in (10, 11) and d == 256)):
            return f"fa4 has no softcap backward on compute capability {major}.x with head dim {d}: use backend='flex'"
        return None

    def reject_reason(self, q, k, tasks, target=None):
        why = _device_reason(q, target)
        if why is not None:
            return why
        # q/k's head dim with some v head dim FA4 pairs it with (v's own is feature_reason's).
        major, d = _major(q, target), q.shape[-1]
        if any(_head_dims_reason(d, dv, major) is None for dv in (d, 128)):
            return None
        return _head_dims_reason(d, d, major)

    def reject_varlen_reason(self, seq_lens, window):
        return fa4_varlen_reason(seq_lens, window)

    # ---- dense blocks: SDPA layout (B, H, L, D) -----------------------------------------------------------
    # FA4 reads (B, L, H, D) with any strides whose last dim is contiguous and the others multiples of
    # 16 bytes (flash_attn.cute.cute_dsl_utils.maybe_contiguous; it copies other tensors itself), so
    # dtcp passes transpose(1, 2) VIEWS of its (B, H, L, D) tensors and of row/key slices of them:
    # no copies for head dims that are multiples of 8. Outputs come back (B, L, H, D) (out) or in
    # q/k/v's own strides (dq, dk, dv: empty_like of the views) and are returned as transposed views.
    def _forward_call(self, q, k, v, call: Fa4Call, scale, softcap, sink, out=None, lse=None):
        res = replayed("fwd")(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
            softcap=None if softcap is None else float(softcap),
            learnable_sink=None if sink is None else sink.to(device=q.device, dtype=torch.float32).contiguous(),
            return_lse=True, out=None if out is None else out.transpose(1, 2), lse=lse, **call.window_args(),
        )
        out, lse = res[0], res[1]  # 4.0.0b36 returns (out, lse, p, row_max, o_lo)
        return out.transpose(1, 2), lse

    def forward(self, q, k, v, lo, hi, scale, softcap=None, sink=None):
        b, hq, lq, _ = q.shape
        lk = k.shape[2]
        call = fa4_call(lq, lk, lo, hi)
        if call.whole(lq, lk):
            return self._forward_call(q, k, v, call, scale, softcap, sink)
        out = torch.zeros((b, hq, lq, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = no_key_rows((b, hq, lq), torch.float32, q.device, sink)
        if not call.empty:
            rows, keys = seq_slice(call.r0, call.r1), seq_slice(call.c0, call.c1)
            o, l = self._forward_call(q[rows], k[keys], v[keys], call, scale, softcap, sink)
            out[rows] = o
            lse[rows] = l
        return out, lse

    def _backward_call(self, dout, q, k, v, out, lse, call: Fa4Call, scale, softcap, dq=None):
        # FA4 wants q, k, v, out and dout of one dtype, lse float32 (B, H, Lq).
        out, dout = _as(out, q.dtype), _as(dout, q.dtype)
        dq, dk, dv = replayed("bwd")(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), dout.transpose(1, 2),
            _as(lse, torch.float32), softmax_scale=scale,
            softcap=0.0 if softcap is None else float(softcap),  # 0.0 is "off" here (None would be taken as a cap)
            dq=None if dq is None else dq.transpose(1, 2), **call.window_args(),
        )[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, lo, hi, scale, softcap=None):
        lq, lk = q.shape[2], k.shape[2]
        call = fa4_call(lq, lk, lo, hi)
        if call.whole(lq, lk):
            return self._backward_call(dout, q, k, v, out, lse, call, scale, softcap)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if not call.empty:
            rows, keys = seq_slice(call.r0, call.r1), seq_slice(call.c0, call.c1)
            grads = self._backward_call(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows],
                                        call, scale, softcap)
            dq[rows], dk[keys], dv[keys] = grads
        return dq, dk, dv

    def forward_into(self, q, k, v, lo, hi, scale, out, lse, softcap=None):
        lq, lk = q.shape[2], k.shape[2]
        call = fa4_call(lq, lk, lo, hi)
        if not call.whole(lq, lk):  # (rows without keys: filled, as forward does)
            return super().forward_into(q, k, v, lo, hi, scale, out, lse, softcap=softcap)
        return landed(self._forward_call(q, k, v, call, scale, softcap, None, out=out, lse=lse),
                      (out, lse))

    def backward_into(self, dout, q, k, v, out, lse, lo, hi, scale, dq, softcap=None):
        lq, lk = q.shape[2], k.shape[2]
        call = fa4_call(lq, lk, lo, hi)
        if not call.whole(lq, lk):
            return super().backward_into(dout, q, k, v, out, lse, lo, hi, scale, dq, softcap=softcap)
        dq_t, dk, dv = self._backward_call(dout, q, k, v, out, lse, call, scale, softcap, dq=dq)
        return landed((dq_t,), (dq,))[0], dk, dv

    # ---- varlen: (T, H, D) rows, one launch -----------------------------------------------------------------
    def varlen_forward(self, q, k, v, seqs: VarlenSeqs, window, scale, softcap=None, sink=None):
        return self.varlen_forward_into(q, k, v, seqs, window, scale, None, None, softcap=softcap, sink=sink)

    def varlen_forward_into(self, q, k, v, seqs: VarlenSeqs, window, scale, out, lse, softcap=None, sink=None):
        # FA4 takes its output tensors (out=, lse=: strided views allowed, last dim contiguous and
        # 16-byte aligned strides, which rows views of (B, H, L, D) tensors with D % 8 == 0 have).
        res = replayed("fwd")(
            q, k, v, cu_seqlens_q=_as(seqs.cu_q_t, torch.int32), cu_seqlens_k=_as(seqs.cu_k_t, torch.int32),
            seqused_q=seqs.used_q_t, seqused_k=seqs.used_k_t,
            max_seqlen_q=seqs.max_q, max_seqlen_k=seqs.max_k, softmax_scale=scale,
            softcap=None if softcap is None else float(softcap),
            learnable_sink=None if sink is None else sink.to(device=q.device, dtype=torch.float32).contiguous(),
            return_lse=True, out=out, lse=lse, **fa4_varlen_window(window),
        )
        return res[0], res[1]  # out (Tq, Hq, Dv), lse (Hq, Tq) float32

    def varlen_backward(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale, softcap=None):
        return self.varlen_backward_into(dout, q, k, v, out, lse, seqs, window, scale, softcap=softcap)

    def varlen_backward_into(self, dout, q, k, v, out, lse, seqs: VarlenSeqs, window, scale, softcap=None,
                             dq=None, dk=None, dv=None):
        dq, dk, dv = replayed("bwd")(
            q, k, v, _as(out, q.dtype), _as(dout, q.dtype), _as(lse, torch.float32), softmax_scale=scale,
            softcap=0.0 if softcap is None else float(softcap),
            cu_seqlens_q=_as(seqs.cu_q_t, torch.int32), cu_seqlens_k=_as(seqs.cu_k_t, torch.int32),
            seqused_q=seqs.used_q_t, seqused_k=seqs.used_k_t,
            max_seqlen_q=seqs.max_q, max_seqlen_k=seqs.max_k, dq=dq, dk=dk, dv=dv, **fa4_varlen_window(window),
        )[:3]
        return dq, dk, dv
