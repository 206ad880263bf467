"""What the ring moves and what it accumulates, beyond exactness: a block travels only with the
keys its holders use (its span), senders and receivers agree on every span (a disagreement would
hang a rank or misread a buffer), and the float32 accumulators cover only the rows that several
steps add to. Exactness in low precision for the paths this opens up, on spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtcp
from dist_harness import run_ranks
from dtcp.plan import AttnMask, RingPlan, ring_plans, segments_from_cu_seqlens
from reference import reference_attention, rel_err, window_doc_mask

LAYOUTS = [dtcp.Contiguous(), dtcp.Zigzag(), dtcp.Striped(1)]
CASES = [  # (is_causal, window, cu_seqlens over 24 tokens)
    (True, (-1, -1), None), (False, (-1, -1), None), (True, (0, 0), None), (True, (2, 0), None),
    (True, (5, 0), None), (True, (13, 0), None), (False, (2, 3), None), (False, (0, 9), None),
    (True, (-1, -1), (0, 5, 6, 17, 24)), (True, (3, 0), (0, 2, 13, 24)), (False, (-1, -1), (0, 11, 24)),
]


def _plans(layout, n, is_causal, window, cu, seq_len=24):
    segments = segments_from_cu_seqlens(cu, seq_len) if cu is not None else None
    return ring_plans(layout, seq_len // n, n, is_causal, AttnMask.make(is_causal, window, segments))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.spec())
@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_spans_are_the_used_keys_and_both_ends_agree(layout, world_size):
    if 24 % layout.multiple(world_size):
        pytest.skip(f"24 tokens do not split over {world_size} ranks as {layout.spec()}")
    for is_causal, window, cu in CASES:
        plans = _plans(layout, world_size, is_causal, window, cu)
        n = world_size
        for r, plan in enumerate(plans):
            assert plan.steps[0].span == plan.steps[0].home_span == (0, plan.local_len)
            for t, step in enumerate(plan.steps[1:], start=1):
                # the span is the hull of the keys every holder of this block in this chain uses
                holders = [p.steps[t2] for p in plans for t2 in range(1, len(p.steps))
                           if p.steps[t2].src == step.src and p.steps[t2].shift == step.shift]
                used = [(x.k_start, x.k_end) for h in holders for x in h.tasks]
                hull = (min(a for a, _ in used), max(b for _, b in used)) if used else (0, 0)
                assert step.span == hull, (r, t, step)
                assert all(step.span[0] <= x.k_start < x.k_end <= step.span[1] for x in step.tasks)
                # what the sender sends in round t - 1 is exactly what we receive
                sender = plans[(r - step.shift) % n]
                if plan.starts_chain(t):
                    sent_block, sent = sender.rank, sender.steps[t].home_span
                else:
                    sent_block, sent = sender.steps[t - 1].src, sender.steps[t - 1].span
                assert (sent_block, sent) == (step.src, step.span), (r, t, sender.rank)
                # dK/dV come home at a chain's end with the owner's home span of that chain
                end = t == plan.num_rounds or plan.starts_chain(t + 1)
                if end:
                    assert plans[step.src].steps[t].home_span == step.span


def test_a_window_sends_its_span_not_the_block():
    """Contiguous, causal window 5 over 4 ranks of 6 tokens: each rank but the last sends the
    last 5 keys of its block to the next rank; the last rank's block is needed by nobody."""
    for r, plan in enumerate(_plans(dtcp.Contiguous(), 4, True, (5, 0), None)):
        assert plan.num_rounds == 1
        assert plan.steps[1].src == (r - 1) % 4
        assert plan.steps[1].span == ((1, 6) if r > 0 else (0, 0))
        assert plan.steps[1].home_span == ((1, 6) if r < 3 else (0, 0))


def test_a_two_sided_window_takes_two_short_chains():
    """Non-causal window (2, 5) over 4 ranks of 4 tokens: 3 rounds either way, but one forward hop
    (the last 2 keys) and two backward hops beat three forward hops whose spans are whole blocks."""
    plans = ring_plans(dtcp.Contiguous(), 4, 4, False, AttnMask.make(False, (2, 5)))
    assert [s.shift for s in plans[1].steps] == [0, 1, -1, -1]
    assert plans[1].steps[1].span == (2, 4)


# ---- exactness in low precision (rows kept as the kernel returned them, float32 elsewhere) ----

def window_errors(dtype_name, s, is_causal, window, cu=None):
    dtype = getattr(torch, dtype_name)
    layout = dtcp.Contiguous()
    g = torch.Generator().manual_seed(s + window[0])
    q, k, v = (torch.randn(1, h, s, 32, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(1, 4, s, 32, generator=g, dtype=torch.float64)
    mask = window_doc_mask(s, is_causal=is_causal, window=window, cu_seqlens=cu)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = reference_attention(*ref, is_causal=is_causal, mask=mask)
    out_ref.backward(dout)
    kwargs = dict(layout=layout, is_causal=is_causal, window_size=window, enable_gqa=True, backend="math",
                  return_lse=True)
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    local = [layout.shard(t.to(dtype), dim=2).detach().requires_grad_() for t in (q, k, v)]
    out, lse = dtcp.ring_attention(*local, **kwargs)
    out.backward(layout.shard(dout.to(dtype), dim=2))
    # the same kernel on one process over the whole sequence: its own error, on this rank's rows
    whole = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    o1, l1 = dtcp.ring_attention(*whole, _one_rank_group(), **kwargs)
    o1.backward(dout.to(dtype))
    shard = lambda t: layout.shard(t, dim=2)  # noqa: E731
    got = {"out": out, "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    own = {"out": shard(o1), "lse": shard(l1), "dq": shard(whole[0].grad), "dk": shard(whole[1].grad),
           "dv": shard(whole[2].grad)}
    want = {"out": shard(out_ref), "lse": shard(lse_ref), "dq": shard(ref[0].grad), "dk": shard(ref[1].grad),
            "dv": shard(ref[2].grad)}
    assert out.dtype == dtype and out.is_contiguous() and local[0].grad.is_contiguous()
    return {key: (rel_err(got[key], want[key]), rel_err(own[key], want[key])) for key in got}


_GROUPS = {}


def _one_rank_group():
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank not in _GROUPS:  # new_group is collective: every rank makes every one-rank group
        for r in range(dist.get_world_size()):
            _GROUPS[r] = dist.new_group([r])
    return _GROUPS[rank]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("is_causal,window", [(True, (24, 0)), (True, (100, 0)), (False, (10, 70))], ids=str)
def test_low_precision_window_within_the_kernels_own_error(dtype_name, world_size, is_causal, window):
    """Contiguous windows in float32 and bfloat16 (the local block's rows that no other step
    touches are the kernel's output as it was; the rest merge in float32): every rank's error
    on out, lse, dq, dk, dv stays within 1.5x the same kernel's error over the whole sequence."""
    for rank, errs in enumerate(run_ranks(world_size, window_errors, dtype_name, 256, is_causal, window)):
        for key, (ring, own) in errs.items():
            assert ring <= 1.5 * own + 1e-12, (rank, key, ring, own)


# ---- float32 accumulators only where several steps add ----------------------------------------

class _AccumulatorWrites(TorchDispatchMode):
    """Bytes written into float32 tensors by the ring's own ops (not the kernels', not views)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.in_kernel = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_kernel and not func.is_view:
            written = args[0] if func._schema.is_mutable else out
            for t in written if isinstance(written, (tuple, list)) else [written]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.bytes += t.numel() * 4
        return out


class _Counted:
    """A kernel whose calls the counting mode does not see."""

    def __init__(self, kernel, mode):
        self.kernel, self.mode = kernel, mode
        self.name, self.varlen_one_launch = kernel.name, kernel.varlen_one_launch  # (the ring asks)

    def _unseen(self, method, *a, **kw):
        self.mode.in_kernel = True
        try:
            return method(*a, **kw)
        finally:
            self.mode.in_kernel = False

    def forward(self, *a, **kw):
        return self._unseen(self.kernel.forward, *a, **kw)

    def backward(self, *a, **kw):
        return self._unseen(self.kernel.backward, *a, **kw)

    def grad_dtype(self, dtype):
        return self.kernel.grad_dtype(dtype)


def _accumulator_bytes(monkeypatch, whole_path: bool, mask=None) -> int:
    from dtcp.comm.p2p import NoComm
    from dtcp.exec import ring
    from dtcp.kernels.math import MathKernel

    if whole_path:  # the path every schedule took before: float32 over every row and key
        monkeypatch.setattr(RingPlan, "local_calls_disjoint", property(lambda plan: False))
    local_len = 256
    plan = ring_plans(dtcp.Contiguous(), local_len, 2, True, mask or AttnMask.make(True, (16, 0)))[1]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, local_len, 32, generator=g).to(torch.bfloat16) for _ in range(4))
    mode = _AccumulatorWrites()
    kernel = _Counted(MathKernel(), mode)
    # (launch by launch, through the float32 accumulators these tests measure: no slots)
    with mode, dtcp.config.override(merge_slots_bytes=0):
        out, lse = ring.ring_forward(q, k, v, plan, kernel, 32 ** -0.5, NoComm())
        ring.ring_backward(dout, q, k, v, out, lse, plan, kernel, 32 ** -0.5, NoComm())
    monkeypatch.undo()
    return mode.bytes


def test_float32_accumulators_cover_only_the_merged_rows(monkeypatch):
    """Causal window 16 on a contiguous rank of 256 tokens: only the first 16 rows (and, coming
    home, no keys: nobody to the left) take a float32 merge. The ring's own float32 writes drop
    to a small fraction of what accumulating every row and key writes; what is left is the
    float32 lse of every row and the window's 16 rows."""
    kept = _accumulator_bytes(monkeypatch, whole_path=False)
    everything = _accumulator_bytes(monkeypatch, whole_path=True)
    assert kept < 0.2 * everything, (kept, everything)


def test_the_cost_model_moves_the_span():
    """The model's ring transfer for a contiguous causal window of 4096 at 128K tokens on 2
    ranks carries the window's 4096 keys per round, not the 65536 of a block."""
    from dtcp.exec.route import _keys_per_round
    from dtcp.plan import MACHINES, CallShape, predict

    mask = AttnMask.make(True, (4096, 0))
    kv_len = _keys_per_round(ring_plans, dtcp.Contiguous(), 65536, 2, True, [mask])
    assert kv_len == 4096
    base = dict(batch=1, q_heads=32, kv_heads=32, head_dim=128, v_head_dim=128, elem_bytes=2, world_size=2,
                local_len=65536, ring_pairs=65536 * 4097, ring_rounds=1)
    machine = MACHINES["h200-nvlink"]
    spans = predict("ring", CallShape(**base, ring_kv_len=kv_len), machine)
    blocks = predict("ring", CallShape(**base), machine)
    bytes_ratio = (spans.comm_s - 3 * machine.latency_s) / (blocks.comm_s - 3 * machine.latency_s)
    assert abs(bytes_ratio - 4096 / 65536) < 1e-12, bytes_ratio
    assert spans.total_s < blocks.total_s


def test_float32_accumulators_cover_only_the_merged_rows_of_documents(monkeypatch):
    """Documents [0, 240), [240, 300), [300, 400), [400, 512) over 2 contiguous ranks of 256:
    rank 1's local calls are one per document piece (disjoint), and only the 44 rows of the
    document that started on rank 0 merge in float32."""
    mask = AttnMask.make(True, (-1, -1), segments_from_cu_seqlens((0, 240, 300, 400, 512), 512))
    kept = _accumulator_bytes(monkeypatch, whole_path=False, mask=mask)
    everything = _accumulator_bytes(monkeypatch, whole_path=True, mask=mask)
    assert kept < 0.3 * everything, (kept, everything)
