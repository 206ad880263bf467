"""torch.library.opcheck on dtcp's custom ops, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import assert_each_error_names_its_fix, error_messages_of
from dtcp import _groups


def opcheck_ops(is_causal):
    torch.manual_seed(dist.get_rank())
    q = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    name = _groups.group_name(None)
    args = (q, k, v, name, "zigzag", is_causal, 0.35, "math")
    torch.library.opcheck(torch.ops.dtcp.ring_attention_forward.default, args)
    out, lse = torch.ops.dtcp.ring_attention_forward(*args)
    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), name, "zigzag", is_causal, 0.35, "math")
    torch.library.opcheck(torch.ops.dtcp.ring_attention_backward.default, bargs)
    return True


@pytest.mark.parametrize("is_causal", [True, False])
def test_opcheck(is_causal):
    assert all(run_ranks(2, opcheck_ops, is_causal, timeout=300))


def error_messages():
    """Each bad call must raise with a message naming the problem; collect the messages."""
    f64 = dict(dtype=torch.float64)
    q = torch.randn(1, 4, 8, 8, **f64)
    k = torch.randn(1, 2, 8, 8, **f64)
    cases = {
        "uneven": lambda: dtcp.ring_attention(torch.randn(1, 4, 3, 8, **f64), torch.randn(1, 4, 3, 8, **f64),
                                              torch.randn(1, 4, 3, 8, **f64), layout=dtcp.Zigzag()),
        "striped_block": lambda: dtcp.ring_attention(torch.randn(1, 4, 3, 8, **f64), torch.randn(1, 4, 3, 8, **f64),
                                                     torch.randn(1, 4, 3, 8, **f64), layout=dtcp.Striped(2)),
        "kv_shape": lambda: dtcp.ring_attention(q, k, torch.randn(1, 2, 6, 8, **f64), enable_gqa=True),
        "seq_mismatch": lambda: dtcp.ring_attention(q, torch.randn(1, 4, 6, 8, **f64), torch.randn(1, 4, 6, 8, **f64)),
        "heads_multiple": lambda: dtcp.ring_attention(q, torch.randn(1, 3, 8, 8, **f64), torch.randn(1, 3, 8, 8, **f64), enable_gqa=True),
        "gqa_flag": lambda: dtcp.ring_attention(q, k, k.clone()),
        "dtype_mix": lambda: dtcp.ring_attention(q, k.float(), k.float(), enable_gqa=True),
        "int_dtype": lambda: dtcp.ring_attention(q.long(), k.long(), k.long(), enable_gqa=True),
        "three_d": lambda: dtcp.ring_attention(q[0], k[0], k[0], enable_gqa=True),
        "backend": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, backend="nope"),
        "backend_cuda_on_cpu": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, backend="cudnn"),
        "flex_on_cpu": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, backend="flex"),
        "fa2_missing": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, backend="fa2"),
        "layout_name": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, layout="spiral"),
        "mesh_2d": lambda: dtcp.ring_attention(q, k, k.clone(), dist.device_mesh.init_device_mesh("cpu", (1, dist.get_world_size())), enable_gqa=True, strategy="ring"),
        "hybrid_1d": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, strategy="hybrid"),
        "alias_disagrees": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, strategy="ring", kv_exchange="allgather"),
        "striped_zero": lambda: dtcp.Striped(0),
        "strategy": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, strategy="alltoall"),
        "kv_exchange": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, kv_exchange="ulysses"),
        "allgather_striped": lambda: dtcp.ring_attention(q, k, k.clone(), enable_gqa=True, layout="striped:1",
                                                         strategy="allgather"),
    }
    return error_messages_of(cases)


EXPECTED = {
    "uneven": "multiple of 4",  # zigzag over 2 ranks: 2N
    "striped_block": "multiple of 4",  # striped:2 over 2 ranks: N*block
    "kv_shape": "k and v must have the same shape but for the head dim",
    "seq_mismatch": "same local tokens",
    "heads_multiple": "multiple of the key/value heads",
    "gqa_flag": "enable_gqa=True",
    "dtype_mix": "share one dtype",
    "int_dtype": "floating-point",
    "three_d": "must be 4-D",
    "backend": "backend must be 'auto' or one of",
    "backend_cuda_on_cpu": "cudnn needs CUDA tensors",
    "flex_on_cpu": "flex needs CUDA tensors",
    "fa2_missing": "fa2 needs the flash-attn package",
    "layout_name": "unknown layout",
    "mesh_2d": "strategy='ring' runs on a 1-D group, and group is a 2-D mesh",
    "hybrid_1d": "strategy='hybrid' needs a 2-D context-parallel mesh",
    "alias_disagrees": "strategy='ring' and kv_exchange='allgather' disagree",
    "striped_zero": "positive int",
    "strategy": "strategy must be one of ('auto', 'ring', 'allgather', 'ulysses', 'hybrid')",
    "kv_exchange": "kv_exchange must be one of ('auto', 'ring', 'allgather')",
    "allgather_striped": "Use strategy='ring'",
}


def test_bad_inputs_raise_clear_errors():
    messages = run_ranks(2, error_messages)[0]
    assert_each_error_names_its_fix(messages, EXPECTED)


def test_layout_errors_without_process_group():
    with pytest.raises(ValueError, match="multiple of 8"):
        dtcp.Zigzag().check(12, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        dtcp.ring_attention(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4))


def test_cudnn_refuses_single_token_blocks():
    from dtcp.kernels import KERNELS
    from dtcp.plan import Task

    class FakeCuda:  # only what reject_reason reads
        device = torch.device("cuda")
        dtype = torch.bfloat16
        shape = (1, 8, 16, 64)

    why = KERNELS["cudnn"].reject_reason(FakeCuda(), FakeCuda(), [Task(0, 16, 0, 16, None, 0), Task(3, 4, 3, 4, None, 0)])
    assert why is not None and "1x1" in why
    assert KERNELS["cudnn"].reject_reason(FakeCuda(), FakeCuda(), [Task(0, 16, 0, 16, None, 0)]) is None


def test_flash_kernels_refuse_bands_flash_would_drop():
    """FA2 treats window_size_right >= seqlen_k as unbounded (700x300 band (-500, 0) came out
    wrong on H200 with torch's flash and flash-attn 2.8.3): such tasks must go to another kernel."""
    from dtcp.kernels import flash_band_reason
    from dtcp.plan import Task

    why = flash_band_reason([Task(0, 700, 0, 300, -500, 0)], "flash")
    assert why is not None and "drops a right window" in why
    for ok in (Task(0, 300, 0, 700, -200, 450), Task(0, 64, 0, 64, None, 0), Task(0, 700, 0, 300, None, None),
               Task(0, 700, 0, 300, -500, 299)):
        assert flash_band_reason([ok], "flash") is None, ok


def fast_path_vs_op(layout_spec, kv_exchange="auto"):
    """The eager fast path and the custom op give bit-identical out, lse and gradients."""
    results = []
    for fast in (True, False):
        with dtcp.config.override(eager_fast_path=fast):
            torch.manual_seed(dist.get_rank())
            q = torch.randn(2, 4, 8, 6, dtype=torch.float64, requires_grad=True)
            k = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
            v = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
            out, lse = dtcp.ring_attention(q, k, v, layout=layout_spec, is_causal=True, enable_gqa=True,
                                           backend="math", return_lse=True, kv_exchange=kv_exchange)
            is_op = out.grad_fn.name().startswith("GeneratedBackwardFor_dtcp")
            out.backward(torch.cos(out.detach()))
            results.append((is_op, [out.detach(), lse, q.grad, k.grad, v.grad]))
    (fast_is_op, fast_vals), (op_is_op, op_vals) = results
    assert not fast_is_op and op_is_op, (fast_is_op, op_is_op)
    for a, b in zip(fast_vals, op_vals):
        assert torch.equal(a, b)
    return True


@pytest.mark.parametrize("layout_spec,kv_exchange", [("zigzag", "ring"), ("striped:2", "ring"), ("zigzag", "allgather")])
def test_eager_fast_path_equals_the_custom_op(layout_spec, kv_exchange):
    assert all(run_ranks(2, fast_path_vs_op, layout_spec, kv_exchange))


def test_fast_path_only_for_plain_eager_calls():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from dtcp import _compat

    x = torch.randn(2)
    assert _compat.plain_eager_call(x, x, x, None)
    with FakeTensorMode():
        assert not _compat.plain_eager_call(x, x, x, None)
    with FlopCounterMode(display=False):
        assert not _compat.plain_eager_call(x, x, x, None)
    seen = torch.func.vmap(lambda t: torch.tensor(_compat.plain_eager_call(t)))(torch.randn(3, 2))
    assert not seen.any()
    assert not _compat.plain_eager_call(torch.nn.Parameter(x))  # a subclass
