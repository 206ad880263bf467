"""FlashAttention-4's wrapper replayed (dtcp/kernels/replay.py, dtcp.config.kernel_replay) on the
calls a ring makes, on one GPU: N = 4 ranks simulated (tests/sim_ranks.py), each case run with the
wrapper called every time and then with its recordings replayed.

The forward's out and lse must be the same bits (FA4's forward is deterministic); the gradients
within one bf16 step of the largest value (FA4's backward adds dQ, and GQA's dK/dV, with float32
atomics in any order, so two runs of the same call may differ in their last bit). Every FA4 call
of the ring must be replayed: none refused.

    python -m pytest -q -s tests/gpu/test_fa4_replay.py
"""

from __future__ import annotations

import pytest
import torch

import dtcp
from dtcp.kernels import KERNELS
from sim_ranks import simulated_ring
from test_one_gpu_ranks import CASES, D, HKV, HQ, S

pytestmark = pytest.mark.one_gpu

REPLAY_CASES = [c for c in CASES if c[0] in ("causal zigzag", "documents balanced", "documents doczigzag",
                                              "window documents contiguous")]


@pytest.mark.parametrize("name,make_layout,docs,window", REPLAY_CASES, ids=[c[0] for c in REPLAY_CASES])
def test_fa4_replayed_calls_give_the_wrappers_results(name, make_layout, docs, window):
    from dtcp.kernels.fa4 import REPLAY_CHECKED, _release, replayed

    kernel = KERNELS["fa4"]
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = (torch.randn(1, h, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
                     for h in (HQ, HKV, HKV, HQ))
    why = kernel.feature_reason(q, v, None, False) or kernel.reject_reason(q, k, [])
    if why is not None:
        pytest.skip(f"fa4: {why}")
    assert _release() in REPLAY_CHECKED, f"flash-attn-4 {_release()} is not a release replay was checked on"
    n, layout = 4, make_layout(4, docs)

    def run():
        return simulated_ring(layout, n, q, k, v, dout, kernel, window=window, docs=docs, scale=D ** -0.5)

    with dtcp.config.override(kernel_replay=False):
        want = run()  # (compiles what the case needs)
    fwd, bwd = replayed("fwd"), replayed("bwd")
    before = [dict(w.stats) for w in (fwd, bwd)]
    for _ in range(3):  # records, then replays
        got = run()
    for w, was in zip((fwd, bwd), before):
        new = {key: w.stats[key] - was[key] for key in w.stats}
        print(f"\n{name}: {w.name} {new}")
        assert new["replayed"] > 0 and new["refused"] == 0 and new["other"] == 0, (w.name, new, w.refusals)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    for key, a, b in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        step = b.abs().max().item() * 2.0 ** -7
        assert (a.float() - b.float()).abs().max().item() <= step, (name, key)
