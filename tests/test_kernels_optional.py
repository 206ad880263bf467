"""CPU tests for the optional CUDA kernels' pure-torch parts: flex's block mask from a band, and
the flex backward's reweighting of a block's gradient to the merged (global) out and lse, run
inside a custom op as the ring runs it. The kernels themselves run on GPUs only
(benchmarks/check_kernels.py, benchmarks/check_correctness.py --backends flex fa2)."""

import pytest
import torch

from dtcp.exec.merge import merge_into_
from dtcp.kernels import KERNELS
from dtcp.kernels import flex as kernels_optional
from dtcp.kernels.base import _band_mask_cpu

BANDS = [(None, 0), (-200, 450), (-500, 0), (None, 300), (3, 100), (-1000, -1)]


@pytest.mark.parametrize("lq,lk", [(128, 128), (300, 700), (700, 300), (257, 513), (1024, 384)])
@pytest.mark.parametrize("lo,hi", BANDS)
def test_band_block_mask_matches_the_dense_band(lq, lk, lo, hi):
    mask = kernels_optional.band_block_mask(lq, lk, lo, hi, "cpu")
    dense = _band_mask_cpu(lq, lk, lo, hi)
    b = kernels_optional._FLEX_BLOCK
    nq, nk = -(-lq // b), -(-lk // b)
    padded = torch.zeros(nq * b, nk * b, dtype=torch.bool)
    padded[:lq, :lk] = dense
    blocks = padded.view(nq, b, nk, b)
    some = blocks.any(3).any(1)
    # "full" blocks: every in-bounds pair visible (flex masks the out-of-bounds tail itself)
    inside = torch.zeros_like(padded)
    inside[:lq, :lk] = True
    every = (padded | ~inside).view(nq, b, nk, b).all(3).all(1) & some
    assert torch.equal(mask.to_dense()[0, 0].bool(), some)
    full = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        n = int(mask.full_kv_num_blocks[0, 0, i])
        full[i, mask.full_kv_indices[0, 0, i, :n].long()] = True
    assert torch.equal(full, every)
    # the element-level mask_mod is the band itself
    qi, ki = torch.meshgrid(torch.arange(lq), torch.arange(lk), indexing="ij")
    assert torch.equal(mask.mask_mod(0, 0, qi, ki), dense)


def test_full_band_has_no_block_mask():
    assert kernels_optional.band_block_mask(300, 700, None, None, "cpu") is None


def _math_attention_with_lse(q, k, v, lo, hi, scale):
    """Differentiable stand-in for compiled flex on CPU (flex has no CPU backward)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~_band_mask_cpu(q.shape[2], k.shape[2], lo, hi), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ vv, lse


@torch.library.custom_op("dtcp_test::flex_blocks_backward", mutates_args=())
def _flex_blocks_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, split: int) -> list[torch.Tensor]:
    """The flex backward over two key blocks [0, split) and [split, L) with the merged out/lse,
    inside a custom op (where autograd is off unless the kernel turns it back on)."""
    flex = KERNELS["flex"]
    dq0, dk0, dv0 = flex.backward(dout, q, k[:, :, :split], v[:, :, :split], out, lse, None, split, 1.0)
    dq1, dk1, dv1 = flex.backward(dout, q, k[:, :, split:], v[:, :, split:], out, lse, None, 0, 1.0)
    return [dq0 + dq1, torch.cat([dk0, dk1], 2), torch.cat([dv0, dv1], 2)]


@_flex_blocks_backward.register_fake
def _(dout, q, k, v, out, lse, split):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def test_flex_backward_reweights_blocks_to_the_global_softmax(monkeypatch):
    """Band attention (key j visible from query i iff j <= i + split) over L keys split in two
    blocks: [0, split) with band (None, split) and [split, L) with band (None, 0), so every row
    sees keys in both. The sum of the per-block backward with the merged out/lse equals the full
    gradient, in float64."""
    monkeypatch.setattr(kernels_optional.FlexKernel, "_run", lambda self, q, k, v, lo, hi, scale, softcap=None:
                        _math_attention_with_lse(q, k, v, lo, hi, scale))
    torch.manual_seed(0)
    b, hq, hkv, length, d, split = 2, 4, 2, 24, 8, 10
    q = torch.randn(b, hq, length, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, length, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, length, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, hq, length, d, dtype=torch.float64)
    ref_out, ref_lse = _math_attention_with_lse(q, k, v, None, split, 1.0)
    ref_out.backward(dout)
    with torch.no_grad():  # forward per block and merge, as the ring does
        flex = KERNELS["flex"]
        o0, l0 = flex.forward(q, k[:, :, :split], v[:, :, :split], None, split, 1.0)
        o1, l1 = flex.forward(q, k[:, :, split:], v[:, :, split:], None, 0, 1.0)
        out, lse = o0.clone(), l0.clone()
        merge_into_(out, lse, o1, l1)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-12, atol=1e-12)
    grads = _flex_blocks_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, split)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---- FlashAttention-4 (dtcp/kernels/fa4.py) ---------------------------------------------------------------
# The kernel runs on GPUs only (benchmarks/check_fa4.py, check_correctness.py --backends fa4). Here:
# its registration and refusals, the exact band -> FA4 window conversion, and its plumbing (layouts,
# sub-blocks, sinks, varlen) against a float64 stand-in for flash_attn.cute.interface that follows
# FA4's documented semantics and asserts the preconditions dtcp promises it.
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from dtcp.kernels import AUTO_ORDER, select_kernel  # noqa: E402
from dtcp.kernels import fa4 as fa4_mod  # noqa: E402
from dtcp.kernels.base import VarlenSeqs  # noqa: E402
from dtcp.plan import Band, Task  # noqa: E402


def fa4_keep(sq, sk, causal, left, right):
    """FA4's mask on a sq x sk sequence (flash_attn/cute/interface.py _resolve_causal_local_window,
    then mask.py): two negative bounds mean unbounded; causal sets right = 0; key col kept for
    query row iff row + sk - sq - left <= col <= row + sk - sq + right, None = unbounded."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    row, col = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None:
        keep &= col <= row + sk - sq + right
    if left is not None:
        keep &= col >= row + sk - sq - left
    return keep


def fa4_call_mask(lq, lk, lo, hi):
    """The mask dtcp's FA4 call gives on the whole block: FA4's mask on the sub-block, placed."""
    c = fa4_mod.fa4_call(lq, lk, lo, hi)
    full = torch.zeros(lq, lk, dtype=torch.bool)
    if not c.empty:
        a = c.window_args()
        full[c.r0:c.r1, c.c0:c.c1] = fa4_keep(c.r1 - c.r0, c.c1 - c.c0, a["causal"], a["window_size_left"],
                                              a["window_size_right"])
    return c, full


_LENS = [1, 2, 3, 7, 16, 33, 64, 100]
_OFFSETS = [None, -150, -100, -64, -33, -7, -2, -1, 0, 1, 2, 7, 33, 64, 99, 150]


def test_fa4_call_is_exact_for_every_band():
    """The FA4 call (sub-block and window) keeps exactly the band's keys, brute force over lengths
    and bounds, with FA4's preconditions: both window sides >= 0, row 0 of the sub-block sees key 0,
    its last row the last key (so no query tile of FA4 is without a key block)."""
    checked = 0
    for lq in _LENS:
        for lk in _LENS:
            for lo in _OFFSETS:
                for hi in _OFFSETS:
                    c, got = fa4_call_mask(lq, lk, lo, hi)
                    want = _band_mask_cpu(lq, lk, lo, hi)
                    assert torch.equal(got, want), (lq, lk, lo, hi, c)
                    if not c.empty:
                        sub = want[c.r0:c.r1, c.c0:c.c1]
                        assert sub[0, 0] and sub[-1, -1], (lq, lk, lo, hi, c)
                        assert sub.any(1).all() and sub.any(0).all(), (lq, lk, lo, hi, c)
                        assert c.left is None or c.left >= 0
                        assert c.right is None or c.right >= 0
                    else:
                        assert not want.any()
                    checked += 1
    assert checked == len(_LENS) ** 2 * len(_OFFSETS) ** 2


def test_fa4_call_common_blocks_are_whole_and_cheapest():
    """Full and causal blocks (dtcp's causal ring) run whole, as FA4's full or causal kernel."""
    c = fa4_mod.fa4_call(4096, 4096, None, 0)
    assert c.whole(4096, 4096) and c.causal
    c = fa4_mod.fa4_call(2048, 4096, None, None)
    assert c.whole(2048, 4096) and c.window_args() == dict(causal=False, window_size_left=None, window_size_right=None)
    c = fa4_mod.fa4_call(2048, 4096, None, 2048)  # bottom-right causal
    assert c.whole(2048, 4096) and c.causal
    c = fa4_mod.fa4_call(1024, 1024, None, -1)  # strictly below the diagonal: rows 1.., keys ..-2, causal
    assert (c.r0, c.r1, c.c0, c.c1) == (1, 1024, 0, 1023) and c.causal
    c = fa4_mod.fa4_call(1024, 4096, -300, 0)  # a sliding window on keys 0..1023 (no row sees the rest)
    assert (c.r0, c.r1, c.c0, c.c1) == (0, 1024, 0, 1024)
    assert c.window_args() == dict(causal=False, window_size_left=300, window_size_right=0)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (5, 3), (-1, 4), (0, 0), (3, -1)])
def test_fa4_varlen_window_is_exact(window):
    for sq in (1, 3, 9):
        for sk in (1, 3, 9, 20):
            want = Band.from_aligned_window(sq, sk, window)
            if fa4_mod.fa4_varlen_reason([(sq, sk)], window) is not None:
                assert not _band_mask_cpu(sq, sk, want.lo, want.hi)[0].any()  # refused: row 0 sees nothing
                continue
            a = fa4_mod.fa4_varlen_window(window)
            got = fa4_keep(sq, sk, a["causal"], a["window_size_left"], a["window_size_right"])
            assert torch.equal(got, _band_mask_cpu(sq, sk, want.lo, want.hi)), (sq, sk, window)
            assert got.any(1).all()


def test_fa4_is_registered_first_for_cuda_auto():
    kern = KERNELS["fa4"]
    assert isinstance(kern, fa4_mod.Fa4Kernel) and kern.name == "fa4"
    assert AUTO_ORDER["cuda"][0] == "fa4" and "fa4" not in AUTO_ORDER["cpu"]
    assert kern.supports_varlen and kern.varlen_one_launch
    assert kern.takes_softcap and kern.takes_sinks and kern.takes_value_head_dim


def test_fa4_refuses_cpu_tensors_and_auto_on_cpu_never_picks_it():
    kern = KERNELS["fa4"]
    task = Task(0, 64, 0, 64, None, 0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        q = torch.zeros(1, 4, 64, 16, dtype=dtype)
        assert kern.reject_reason(q, q, [task]) == "fa4 needs CUDA tensors; got cpu"
        assert kern.feature_reason(q, q, 30.0, True) == "fa4 needs CUDA tensors; got cpu"
        for varlen in (None, (((64, 64),), (-1, 0))):
            for softcap, sinks in ((None, False), (20.0, False), (None, True)):
                try:
                    chosen = select_kernel("auto", q, q, [task], varlen, v=q, softcap=softcap, sinks=sinks).name
                except ValueError:
                    continue
                assert chosen != "fa4"
    with pytest.raises(ValueError, match="backend='fa4' cannot serve this request: fa4 needs CUDA tensors; got cpu"):
        select_kernel("fa4", torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), [task])


class _CudaLike:
    """Stands in for a CUDA tensor where only device, dtype and shape are read."""

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)


@pytest.fixture
def fresh_fa4_import(monkeypatch):
    monkeypatch.setattr(fa4_mod, "_IMPORT", None)
    monkeypatch.setattr(fa4_mod, "_capability", lambda index: (9, 0))
    yield monkeypatch


def test_fa4_refuses_when_the_package_is_missing(fresh_fa4_import):
    fresh_fa4_import.setitem(sys.modules, "flash_attn", None)  # import flash_attn -> ModuleNotFoundError
    q = _CudaLike((1, 8, 128, 128))
    why = KERNELS["fa4"].reject_reason(q, q, [Task(0, 128, 0, 128)])
    assert why.startswith("fa4 needs FlashAttention-4 (module flash_attn.cute), which is not installed")
    assert 'pip install "dtcp[flash]"' in why
    assert fa4_mod._IMPORT[0] is None  # tried once, remembered
    assert KERNELS["fa4"].feature_reason(q, None, None, False) == why
    with pytest.raises(RuntimeError, match="not installed"):
        fa4_mod._interface()


def test_fa4_refuses_a_broken_install(fresh_fa4_import):
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("flash_attn"):
                raise OSError("libcuda.so.1: cannot open shared object file")
            return None

    fresh_fa4_import.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    for name in [m for m in sys.modules if m.startswith("flash_attn")]:
        fresh_fa4_import.delitem(sys.modules, name)
    q = _CudaLike((1, 8, 128, 128))
    why = KERNELS["fa4"].reject_reason(q, q, [])
    assert "installed but failed to import (OSError: libcuda.so.1" in why


def test_fa4_refusals_on_cuda(fresh_fa4_import):
    kern = KERNELS["fa4"]
    fresh_fa4_import.setattr(fa4_mod, "_IMPORT", (SimpleNamespace(), None))
    ok = _CudaLike((1, 8, 128, 128))
    assert kern.reject_reason(ok, ok, [Task(0, 128, 0, 128, -5, 3)]) is None
    assert kern.feature_reason(ok, _CudaLike((1, 2, 128, 128)), 50.0, True) is None
    q32 = _CudaLike((1, 8, 128, 128), torch.float32)
    assert kern.reject_reason(q32, q32, []) == "fa4 takes float16/bfloat16; got torch.float32"
    assert "multiples of 8" in kern.reject_reason(_CudaLike((1, 8, 128, 60)), ok, [])
    # FA4's Hopper backward: wrong dq for head dims <= 128 that round up to an odd number of 16s
    for d in (16, 48, 80, 112):
        qd = _CudaLike((1, 8, 128, d))
        assert f"wrong gradients for head dim {d}" in kern.reject_reason(qd, qd, [])
    for d in (24, 32, 64, 96, 128, 160, 256):
        qd = _CudaLike((1, 8, 128, d))
        assert kern.reject_reason(qd, qd, []) is None
    assert "up to 256" in kern.reject_reason(_CudaLike((1, 8, 128, 320)), ok, [])
    d192 = _CudaLike((1, 8, 128, 192))
    assert kern.reject_reason(d192, d192, []) is None
    assert kern.feature_reason(d192, _CudaLike((1, 8, 128, 128)), None, False) is None
    assert "GQA" in kern.feature_reason(d192, _CudaLike((1, 2, 128, 128)), None, False)
    assert "(192, 128)" in kern.feature_reason(ok, _CudaLike((1, 8, 128, 64)), None, False)
    fresh_fa4_import.setattr(fa4_mod, "_capability", lambda index: (8, 0))
    assert kern.reject_reason(ok, ok, []).startswith("fa4 needs compute capability >= 9.0")
    fresh_fa4_import.setattr(fa4_mod, "_capability", lambda index: (10, 0))
    assert kern.reject_reason(ok, ok, []) is None
    assert kern.reject_reason(_CudaLike((1, 8, 128, 16)), ok, []) is None  # a Hopper-only bug
    assert kern.reject_reason(d192, d192, []) is None  # (192, 128) exists there
    assert "(192, 192)" in kern.feature_reason(d192, d192, None, False)


# ---- the kernel's plumbing against a float64 stand-in for FA4 ---------------------------------------------
class FakeFa4:
    """flash_attn.cute.interface's _flash_attn_fwd/_bwd as documented (BSHD or varlen THD, lse
    (B, H, L) / (H, T) float32 including the sink, windows bottom-right, softcap after the scale,
    GQA), in float64 on CPU. Asserts what dtcp promises FA4: every row of a masked sequence sees a
    key, no negative bound, a float softcap in the backward, one dtype for q, k, v, out, dout."""

    def __init__(self):
        self.inputs = []

    @staticmethod
    def _bounds(cu, used):
        """Sequence i's rows: [cu[i], cu[i + 1]), or [cu[i], cu[i] + used[i]) with seqused."""
        cu = cu.tolist()
        if used is None:
            return list(zip(cu, cu[1:]))
        assert used.dtype == torch.int32 and used.is_contiguous() and len(used) == len(cu) - 1
        bounds = [(a, a + u) for a, u in zip(cu, used.tolist())]
        assert all(b <= c for (_, b), c in zip(bounds, cu[1:])), (cu, used)
        return bounds

    @classmethod
    def _pieces(cls, x, cu, b_dim, used=None):
        if cu is None:
            return [x[i] for i in range(x.shape[0])]
        return [x[a:b] for a, b in cls._bounds(cu, used)]

    @classmethod
    def _placed(cls, pieces, cu, used, total, dim=0):
        """The pieces at their sequences' rows along `dim`; rows left out by seqused are NaN (what
        FA4 leaves there is undefined: a read of them must show)."""
        if used is None:
            return torch.cat(pieces, dim)
        shape = list(pieces[0].shape)
        shape[dim] = total
        out = torch.full(shape, float("nan"), dtype=pieces[0].dtype)
        for (a, b), piece in zip(cls._bounds(cu, used), pieces):
            out.narrow(dim, a, b - a).copy_(piece)
        return out

    @staticmethod
    def _scores(q, k, scale, softcap, causal, left, right):
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
        capped = None
        if softcap:
            capped = torch.tanh(s / softcap)
            s = softcap * capped
        keep = fa4_keep(q.shape[0], k.shape[0], causal, left, right)
        if causal or left is not None or right is not None:
            assert left is None or left >= 0, left
            assert right is None or right >= 0, right
            assert keep.any(1).all(), "a row without keys reached FA4"
        return s.masked_fill(~keep, float("-inf")), capped, g

    def _flash_attn_fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None,
                        softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                        window_size_right=None, learnable_sink=None, return_lse=False, out=None, lse=None, **rest):
        assert not rest, rest
        assert return_lse
        got = self._fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, softcap,
                        window_size_left, window_size_right, learnable_sink)
        return (*self._into(got, (out, lse)), None, None, None)

    @staticmethod
    def _into(results, into):
        """FA4's output tensors: where given, checked as FA4 checks them (shape, dtype; strided
        allowed, last dim contiguous) and written into, and returned in place of fresh ones."""
        placed = []
        for got, dest in zip(results, into):
            if dest is not None:
                assert dest.shape == got.shape and dest.dtype == got.dtype, (dest.shape, got.shape, dest.dtype)
                assert dest.stride(-1) == 1 and 0 not in dest.stride(), dest.stride()
                got = dest.copy_(got)
            placed.append(got)
        return placed

    def _fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, softcap,
             window_size_left, window_size_right, learnable_sink):
        assert q.dtype == k.dtype == v.dtype
        for t in (cu_seqlens_q, cu_seqlens_k):
            assert t is None or t.dtype == torch.int32
        self.inputs.append((q, k, v))
        outs, lses = [], []
        for qs, ks, vs in zip(self._pieces(q, cu_seqlens_q, 0, seqused_q), self._pieces(k, cu_seqlens_k, 0, seqused_k),
                              self._pieces(v, cu_seqlens_k, 0, seqused_k)):
            s, _, g = self._scores(qs, ks, softmax_scale, softcap, causal, window_size_left, window_size_right)
            if learnable_sink is not None:
                s = torch.cat([s, learnable_sink.double()[:, None, None].expand(-1, s.shape[1], 1)], -1)
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[..., None]).nan_to_num(0.0)[..., : ks.shape[0]]
            outs.append(torch.einsum("hqk,khd->qhd", p, vs.double().repeat_interleave(g, 1)).to(q.dtype))
            lses.append(lse.float())
        if cu_seqlens_q is None:
            return torch.stack(outs), torch.stack(lses)
        return (self._placed(outs, cu_seqlens_q, seqused_q, q.shape[0]),
                self._placed(lses, cu_seqlens_q, seqused_q, q.shape[0], dim=1))

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None,
                        dv=None, **rest):
        assert not rest, rest
        got = self._bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left, window_size_right,
                        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        return tuple(self._into(got, (dq, dk, dv)))

    def _bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left, window_size_right,
             cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        assert isinstance(softcap, float), "FA4's backward reads softcap != 0.0: None would be a cap"
        assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype and lse.dtype == torch.float32
        self.inputs.append((q, k, v))
        lse_pieces = ([lse[i] for i in range(lse.shape[0])] if cu_seqlens_q is None
                      else [lse[:, a:b] for a, b in self._bounds(cu_seqlens_q, seqused_q)])
        uq, uk = seqused_q, seqused_k
        dqs, dks, dvs = [], [], []
        for qs, ks, vs, os_, dos, ls in zip(
                self._pieces(q, cu_seqlens_q, 0, uq), self._pieces(k, cu_seqlens_k, 0, uk),
                self._pieces(v, cu_seqlens_k, 0, uk), self._pieces(out, cu_seqlens_q, 0, uq),
                self._pieces(dout, cu_seqlens_q, 0, uq), lse_pieces):
            s, capped, g = self._scores(qs, ks, softmax_scale, softcap, causal, window_size_left, window_size_right)
            p = torch.exp(s - ls.double()[..., None])
            do = dos.double().transpose(0, 1)  # (H, q, Dv)
            vv = vs.double().repeat_interleave(g, 1).transpose(0, 1)
            dv = p.transpose(-1, -2) @ do
            delta = (do * os_.double().transpose(0, 1)).sum(-1, keepdim=True)
            ds = p * (do @ vv.transpose(-1, -2) - delta)
            if capped is not None:
                ds = ds * (1 - capped * capped)
            dq = ds @ ks.double().repeat_interleave(g, 1).transpose(0, 1) * softmax_scale
            dk = ds.transpose(-1, -2) @ qs.double().transpose(0, 1) * softmax_scale
            hk = ks.shape[1]
            dqs.append(dq.transpose(0, 1).to(q.dtype))
            dks.append(dk.view(hk, g, *dk.shape[1:]).sum(1).transpose(0, 1).to(k.dtype))
            dvs.append(dv.view(hk, g, *dv.shape[1:]).sum(1).transpose(0, 1).to(v.dtype))
        if cu_seqlens_q is None:
            return torch.stack(dqs), torch.stack(dks), torch.stack(dvs)
        return (self._placed(dqs, cu_seqlens_q, uq, q.shape[0]), self._placed(dks, cu_seqlens_k, uk, k.shape[0]),
                self._placed(dvs, cu_seqlens_k, uk, k.shape[0]))


@pytest.fixture
def fake_fa4(monkeypatch):
    fake = FakeFa4()
    monkeypatch.setattr(fa4_mod, "_IMPORT", (fake, None))
    return fake


def _dense(q, k, v, lo, hi, scale, softcap=None, sink=None):
    """float64 reference, differentiable; rows that see nothing: out 0, lse -inf (or the sink)."""
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_band_mask_cpu(q.shape[2], k.shape[2], lo, hi), float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)[..., : k.shape[2]]
    return p @ v.repeat_interleave(g, 1), lse


@pytest.mark.parametrize("lq,lk", [(64, 64), (48, 80), (80, 48)])
@pytest.mark.parametrize("lo,hi", [(None, None), (None, 0), (None, -1), (-20, 5), (-70, -40), (10, None),
                                   (None, -100), (30, 40)])
@pytest.mark.parametrize("heads,dv,softcap,sink", [((4, 4), 16, None, False), ((4, 2), 16, 5.0, False),
                                                   ((4, 1), 24, None, True)])
def test_fa4_kernel_matches_float64_through_the_fake(fake_fa4, lq, lk, lo, hi, heads, dv, softcap, sink):
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    hq, hkv = heads
    q = torch.randn(2, hq, lq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, lk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, lk, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(2, hq, lq, dv, generator=g, dtype=torch.float64)
    # FA4 takes the sink's logits in float32 (dtcp passes them so), so the reference does too.
    sinks = torch.randn(hq, generator=g, dtype=torch.float64).float().double() if sink else None
    scale = 0.3
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _dense(*ref_in, lo, hi, scale, softcap, sinks)
    ref_out.backward(dout)
    kern = KERNELS["fa4"]
    out, lse = kern.forward(q, k, v, lo, hi, scale, softcap=softcap, sink=sinks)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-12, atol=1e-12)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[seen], ref_lse.detach()[seen], rtol=1e-6, atol=1e-6)
    grads = kern.backward(dout, q, k, v, out, lse, lo, hi, scale, softcap=softcap)
    for got, want in zip(grads, (t.grad for t in ref_in)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fa4_kernel_passes_views_not_copies(fake_fa4):
    """(B, H, L, D) -> (B, L, H, D) by transpose views, also for row/key slices of a block."""
    q, k, v = (torch.randn(1, 4, 64, 16, dtype=torch.float64) for _ in range(3))
    KERNELS["fa4"].forward(q, k, v, None, 0, 0.25)
    KERNELS["fa4"].forward(q, k, v, None, -1, 0.25)  # rows 1.., keys ..62
    (q0, k0, v0), (q1, k1, v1) = fake_fa4.inputs
    assert q0.shape == (1, 64, 4, 16) and q0.data_ptr() == q.data_ptr() and k0.data_ptr() == k.data_ptr()
    assert q1.shape == (1, 63, 4, 16) and q1.data_ptr() == q[:, :, 1:].data_ptr() and k1.data_ptr() == k.data_ptr()


def test_fa4_varlen_writes_into_the_given_strided_results(fake_fa4):
    """varlen_forward_into / varlen_backward_into hand FA4 the ring's result views (rows of
    (B, H, L, D) tensors: strided) as out=, lse=, dq=, dk=, dv=, and return those very tensors,
    holding what the fresh calls return; a gradient not asked for comes back fresh."""
    g = torch.Generator().manual_seed(3)
    cu = (0, 7, 20, 32)
    t = torch.tensor(cu, dtype=torch.int32)
    seqs = VarlenSeqs(cu, cu, t, t, 13, 13)
    q, dout = (torch.randn(2, 4, 32, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 32, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rows = lambda x: x[1].transpose(0, 1)  # noqa: E731  (L, H, D) of batch row 1
    kern = KERNELS["fa4"]
    out, lse = kern.varlen_forward(rows(q), rows(k), rows(v), seqs, (-1, 0), 0.3)
    grads = kern.varlen_backward(rows(dout), rows(q), rows(k), rows(v), out, lse, seqs, (-1, 0), 0.3)
    res = [torch.zeros_like(x) for x in (q, q, k, v)]
    res_lse = torch.zeros(2, 4, 32)
    got = kern.varlen_forward_into(rows(q), rows(k), rows(v), seqs, (-1, 0), 0.3, rows(res[0]), res_lse[1])
    assert got[0].data_ptr() == res[0][1].data_ptr() and not got[0].is_contiguous() and got[1] is not None
    torch.testing.assert_close(rows(res[0]), out, rtol=0, atol=0)
    torch.testing.assert_close(res_lse[1], lse, rtol=0, atol=0)
    got = kern.varlen_backward_into(rows(dout), rows(q), rows(k), rows(v), out, lse, seqs, (-1, 0), 0.3,
                                    dq=rows(res[1]), dk=rows(res[2]))
    assert got[0] is not None and got[0].data_ptr() == res[1][1].data_ptr() and got[1].data_ptr() == res[2][1].data_ptr()
    assert got[2].is_contiguous() and (res[3] == 0).all()  # dv: not asked for, fresh
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (res[0][0] == 0).all() and (res[1][0] == 0).all()  # the other batch row untouched


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (6, 0), (5, 3)])
@pytest.mark.parametrize("softcap,sink", [(None, False), (4.0, True)])
@pytest.mark.parametrize("gaps", [(), ("q",), ("k",), ("q", "k")], ids=["packed", "q-gaps", "k-gaps", "gaps"])
def test_fa4_varlen_matches_the_per_sequence_kernel(fake_fa4, window, softcap, sink, gaps):
    """One FA4 varlen call equals the per-sequence loop, packed and with rows or keys left out
    between sequences (seqused_q / seqused_k: the fused ring reads rows that lie apart in place).
    The stand-in puts NaN on left-out rows, so the comparison reads only the sequences' rows."""
    g = torch.Generator().manual_seed(7)
    lens = [(5, 9), (12, 12), (1, 4), (9, 30)]
    skip = (3, 0, 2, 1)  # rows (keys) left out before each sequence, where gapped

    def layout(side):  # (cu, used): starts with the gaps, or packed
        sizes = [lq if side == "q" else lk for lq, lk in lens]
        if side not in gaps:
            return tuple([0] + list(torch.tensor(sizes).cumsum(0).tolist())), None
        starts, pos = [], 0
        for gap, size in zip(skip, sizes):
            starts.append(pos + gap)
            pos += gap + size
        return tuple(starts) + (pos + 2,), tuple(sizes)  # (2 more rows after the last)

    (cu_q, used_q), (cu_k, used_k) = layout("q"), layout("k")
    tensor = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    seqs = VarlenSeqs(cu_q, cu_k, tensor(cu_q), tensor(cu_k), max(a for a, _ in lens), max(b for _, b in lens),
                      used_q, used_k, tensor(used_q), tensor(used_k))
    kern = KERNELS["fa4"]
    assert kern.varlen_gaps and kern.reject_varlen_reason(lens, window) is None
    q = torch.randn(cu_q[-1], 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(cu_k[-1], 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(cu_q[-1], 4, 16, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64) if sink else None
    out, lse = kern.varlen_forward(q, k, v, seqs, window, 0.3, softcap=softcap, sink=sinks)
    want_out, want_lse = fa4_mod.Kernel.varlen_forward(kern, q, k, v, seqs, window, 0.3, softcap=softcap, sink=sinks)
    assert lse.shape == (4, cu_q[-1])
    rows = torch.cat([torch.arange(a, b) for a, b, _, _ in seqs.bounds()])
    keys = torch.cat([torch.arange(c, d) for _, _, c, d in seqs.bounds()])
    assert out.isnan().any() == ("q" in gaps)  # (the stand-in marks the left-out rows)
    torch.testing.assert_close(out[rows], want_out[rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, rows], want_lse[:, rows], rtol=1e-6, atol=1e-6)
    got = kern.varlen_backward(dout, q, k, v, out, lse, seqs, window, 0.3, softcap=softcap)
    want = fa4_mod.Kernel.varlen_backward(kern, dout, q, k, v, out, lse, seqs, window, 0.3, softcap=softcap)
    for a, b, at in zip(got, want, (rows, keys, keys)):
        torch.testing.assert_close(a[at], b[at], rtol=1e-9, atol=1e-9)


def test_fa4_varlen_refuses_sequences_with_keyless_rows():
    why = KERNELS["fa4"].reject_varlen_reason([(8, 8), (10, 4)], (-1, 0))
    assert "10x4" in why and "first rows see no key" in why
    assert KERNELS["fa4"].reject_varlen_reason([(10, 4)], (-1, 6)) is None
    assert KERNELS["fa4"].reject_varlen_reason([(0, 4), (3, 0)], (-1, -1)) is not None


# ---- PyTorch's flash (dtcp/kernels/flash.py): rows without keys -------------------------------------------
# FlashAttention-2 gives rows that see no key a finite lse (+inf in flash-attn's code), which wins
# every merge; on H100 benchmarks/check_kernels.py caught it on block 1024x256, band (None, -768).
# dtcp runs each dense block's keyed_block only. Here: the index math, exhaustively, and the
# kernel's plumbing against a float64 stand-in for aten._flash_attention_forward/backward that
# gives keyless rows lse +inf as FA2 does.
from dtcp.kernels import Target  # noqa: E402
from dtcp.kernels import flash as flash_mod  # noqa: E402
from dtcp.kernels.base import keyed_block  # noqa: E402


def fa2_keep(sq, sk, causal, left, right):
    """FA2's mask on a sq x sk block (flash_api.cpp): causal is (-1, 0); None or a bound >= sk is
    unbounded (-1); key col kept for row iff row + sk - sq - left <= col <= row + sk - sq + right."""
    left, right = (-1 if w is None or w >= sk else w for w in (left, right))
    if causal:
        left, right = -1, 0
    row, col = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= col <= row + sk - sq + right
    if left >= 0:
        keep &= col >= row + sk - sq - left
    return keep


def test_keyed_block_is_exactly_the_rows_and_keys_with_work():
    for lq in _LENS:
        for lk in _LENS:
            for lo in _OFFSETS:
                for hi in _OFFSETS:
                    want = _band_mask_cpu(lq, lk, lo, hi)
                    kb = keyed_block(lq, lk, lo, hi)
                    rows, keys = want.any(1).nonzero().flatten(), want.any(0).nonzero().flatten()
                    if kb.empty:
                        assert not want.any(), (lq, lk, lo, hi)
                        continue
                    assert (kb.r0, kb.r1) == (rows.min().item(), rows.max().item() + 1), (lq, lk, lo, hi, kb)
                    assert (kb.c0, kb.c1) == (keys.min().item(), keys.max().item() + 1), (lq, lk, lo, hi, kb)
                    assert len(rows) == kb.r1 - kb.r0  # the rows with keys are one run
                    sub = _band_mask_cpu(kb.r1 - kb.r0, kb.c1 - kb.c0, kb.band.lo, kb.band.hi)
                    assert torch.equal(sub, want[kb.r0:kb.r1, kb.c0:kb.c1]), (lq, lk, lo, hi, kb)
                    assert kb.whole(lq, lk) == bool(want.any(1).all() and want.any(0).all())


def test_flash_window_on_the_keyed_block_is_exact_where_accepted():
    """Where flash accepts a band (on its keyed block), FA2's window there keeps exactly the
    band's keys, and rows outside the block see none. The H100 failure's block is accepted and
    its first 768 rows are left out of the call."""
    kern, target = KERNELS["flash"], Target("cuda")
    q = torch.empty(1, 2, 1, 64, dtype=torch.bfloat16, device="meta")
    accepted = 0
    for lq in _LENS:
        for lk in _LENS:
            for lo in _OFFSETS:
                for hi in _OFFSETS:
                    if kern.reject_reason(q, q, [Task(0, lq, 0, lk, lo, hi)], target) is not None:
                        continue
                    accepted += 1
                    kb = keyed_block(lq, lk, lo, hi)
                    got = torch.zeros(lq, lk, dtype=torch.bool)
                    if not kb.empty:
                        sq, sk = kb.r1 - kb.r0, kb.c1 - kb.c0
                        a = flash_mod._flash_args(kb.band.aligned_window(sq, sk))
                        got[kb.r0:kb.r1, kb.c0:kb.c1] = fa2_keep(sq, sk, a["causal"], a["window_size_left"],
                                                                 a["window_size_right"])
                    assert torch.equal(got, _band_mask_cpu(lq, lk, lo, hi)), (lq, lk, lo, hi, kb)
    assert accepted > len(_LENS) ** 2 * len(_OFFSETS) ** 2 // 2
    kb = keyed_block(1024, 256, None, -768)
    assert (kb.r0, kb.r1, kb.c0, kb.c1) == (768, 1024, 0, 256) and kb.band == Band(None, 0)
    assert kern.reject_reason(q, q, [Task(0, 1024, 0, 256, None, -768)], target) is None
    # a band whose last rows see nothing: inexpressible on the whole block, exact on its keyed block
    assert flash_mod.flash_band_reason([Task(0, 1000, 0, 600, 3, 100)], "flash") is not None
    assert kern.reject_reason(q, q, [Task(0, 1000, 0, 600, 3, 100)], target) is None


def test_flash_varlen_refuses_sequences_with_keyless_rows():
    why = KERNELS["flash"].reject_varlen_reason([(8, 8), (1024, 256)], (-1, 0))
    assert "1024x256" in why and "first rows see no key" in why
    assert KERNELS["flash"].reject_varlen_reason([(8, 8), (256, 1024)], (-1, 0)) is None


class FakeFlash:
    """aten._flash_attention_forward/backward on (B, L, H, D) blocks in float64 with FA2's mask
    (fa2_keep) and FA2's lse for rows without keys: +inf, out 0. Equal q and k/v head counts."""

    @staticmethod
    def _mask(sq, sk, causal, window_size_left, window_size_right):
        return fa2_keep(sq, sk, causal, window_size_left, window_size_right)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, window_size_left,
                window_size_right):
        assert cu_q is None and dropout == 0.0
        keep = self._mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) * scale
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("bhlm,bmhd->blhd", p, v)
        lse = lse.masked_fill(~keep.any(1), float("inf"))  # FA2: rows without keys
        return out, lse, None, None

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *,
                 scale, window_size_left, window_size_right):
        keep = self._mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) * scale
        p = torch.exp(s - lse.double()[..., None]).masked_fill(~keep, 0.0)
        dv = torch.einsum("bhlm,blhd->bmhd", p, dout)
        dp = torch.einsum("blhd,bmhd->bhlm", dout, v)
        delta = (dout * out).sum(-1).transpose(1, 2)  # (B, H, L)
        ds = p * (dp - delta[..., None])
        return (torch.einsum("bhlm,bmhd->blhd", ds, k) * scale, torch.einsum("bhlm,blhd->bmhd", ds, q) * scale,
                dv)


@pytest.mark.parametrize("lq,lk,lo,hi", [(64, 16, None, -48), (40, 40, None, -13), (50, 30, 3, 10),
                                         (48, 48, -20, 0), (24, 40, None, 16), (30, 30, None, -40)])
def test_flash_kernel_gives_keyless_rows_out_0_and_lse_minus_inf(monkeypatch, lq, lk, lo, hi):
    """Through the stand-in (which, like FA2, gives keyless rows lse +inf), the kernel's out, lse,
    dq, dk, dv equal the float64 math kernel's on the whole block, keyless rows included."""
    fake = FakeFlash()
    monkeypatch.setattr(flash_mod._compat, "cuda_flash_ops", lambda: (fake.forward, fake.backward))
    kern, math_k = KERNELS["flash"], KERNELS["math"]
    g = torch.Generator().manual_seed(lq + lk)
    q, dout = (torch.randn(2, 3, lq, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 3, lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = kern.forward(q, k, v, lo, hi, 0.25)
    ref_out, ref_lse = math_k.forward(q, k, v, lo, hi, 0.25)
    seen = _band_mask_cpu(lq, lk, lo, hi).any(1)
    assert torch.isneginf(lse[..., ~seen]).all() and (out[..., ~seen, :] == 0).all()
    torch.testing.assert_close(out[..., seen, :], ref_out[..., seen, :], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse[..., seen], ref_lse[..., seen], rtol=1e-10, atol=1e-12)
    grads = kern.backward(dout, q, k, v, out, lse, lo, hi, 0.25)
    # (the kernel hands FA2 a float32 lse, as the real op requires: the reference gets the same)
    lse32 = lse.float().double()
    ref = math_k.backward(dout, q, k, v, out, lse32.masked_fill(torch.isneginf(lse32), float("inf")), lo, hi, 0.25)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
