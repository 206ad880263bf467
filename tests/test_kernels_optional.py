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
