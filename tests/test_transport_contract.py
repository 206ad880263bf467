"""The copy-engine transport's contract, checked on CPU with a stand-in that enforces it over gloo:
the ring asks for its receive buffers only from slots already sized for them (K/V when a route is
built, float32 dK/dV before the first backward exchange, in their own region so that growing one
never moves the other), every exchange between neighbours receives into those slots, and a
forward-only run never allocates dK/dV slots. (The real transport runs on the GPUs:
tests/gpu/test_gpu_suite.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import reference_attention, rel_err


class ContractCopyEngine:
    """CopyEngineRing's interface over gloo point-to-point, refusing anything the real one cannot
    do: one flat region per kind holding two slots, receive views packed as the sender packs what
    it sends (each tensor at the next 256-byte boundary), receives only into the slot named."""

    def __init__(self, state):
        self.state, self.pg = state, state.comm_group()
        self.regions: dict = {}  # kind -> (slot_bytes, flat uint8 region of two slots)
        self.events: list = []

    def ensure(self, kind, slot_bytes):
        self.events.append(("ensure", kind, slot_bytes))
        if kind not in self.regions or self.regions[kind][0] < slot_bytes:
            self.regions[kind] = (slot_bytes, torch.empty(2 * slot_bytes, dtype=torch.uint8))

    def _packed(self, kind, shapes_dtypes, index):
        slot_bytes, region = self.regions[kind]
        views, offset = [], index * slot_bytes
        for shape, dtype in shapes_dtypes:
            n = math.prod(shape) * dtype.itemsize
            if offset + n > (index + 1) * slot_bytes:
                raise AssertionError(f"{kind} views of {shapes_dtypes} overflow slot {index} of {slot_bytes} bytes")
            views.append(region[offset:offset + n].view(dtype).view(shape))
            offset += -(-n // 256) * 256
        return views

    def buffers(self, like, kind, dtype=None):
        need = sum(-(-t.numel() * (dtype or t.dtype).itemsize // 256) * 256 for t in like)
        if kind not in self.regions or self.regions[kind][0] < need:
            raise AssertionError(f"buffers({kind}) of {need} bytes before the {kind} slots were sized: {self.events}")
        self.events.append(("buffers", kind, need))
        return [self._packed(kind, [(t.shape, dtype or t.dtype) for t in like], i) for i in range(2)]

    def _slot_index(self, tensors, kind):
        slot_bytes, region = self.regions[kind]
        off = tensors[0].data_ptr() - region.data_ptr()
        if not (0 <= off < 2 * slot_bytes) or off % slot_bytes:
            raise AssertionError(f"a {kind} view outside the {kind} slots")
        return off // slot_bytes

    def fit(self, slot, shapes, kind):
        return self._packed(kind, [(shape, t.dtype) for t, shape in zip(slot, shapes)], self._slot_index(slot, kind))

    def exchange(self, send, recv, shift, kind, index):
        if any(t.numel() for t in recv):
            packed = self._packed(kind, [(t.shape, t.dtype) for t in recv], index)
            if any(t.numel() and t.data_ptr() != p.data_ptr() for t, p in zip(recv, packed)):
                raise AssertionError(f"a {kind} exchange received outside {kind} slot {index}, or unpacked")
        self.events.append(("exchange", kind))
        n, r = self.state.size, self.state.rank
        to = dist.get_global_rank(self.pg, (r + shift) % n)
        frm = dist.get_global_rank(self.pg, (r - shift) % n)
        ops = [dist.P2POp(dist.isend, t, to, self.pg) for t in send if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, frm, self.pg) for t in recv if t.numel()]
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, works):
        for w in works:
            w.wait()

    def drain(self):
        pass


def ring_over_contract(dtype_name, backward, window, v_head_dim=8):
    from dtcp.exec import route as route_mod

    dtype = getattr(torch, dtype_name)
    n = dist.get_world_size()
    g = dist.new_group(list(range(n)))
    engines = []

    def stand_in(state, device):
        if state.size == 1:
            return None
        engines.append(ContractCopyEngine(state))
        return engines[-1]

    saved = route_mod.copy_engine_ring
    route_mod.copy_engine_ring = stand_in
    try:
        layout = dtcp.Contiguous() if window else dtcp.Zigzag()
        s = 16 * n
        gen = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(2, h, s, d, generator=gen, dtype=torch.float64)
                         for h, d in ((4, 8), (2, 8), (2, v_head_dim), (4, v_head_dim)))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = None
        if window:
            i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
            mask = (j <= i) & (j >= i - window[0])
        out_ref, _ = reference_attention(*ref, is_causal=True, mask=mask)
        out_ref.backward(dout)
        local = [layout.shard(t, g, dim=2).to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = dtcp.ring_attention(*local, g, layout=layout, is_causal=True, enable_gqa=True, strategy="ring",
                                  window_size=window)
        errs = {"out": rel_err(out, layout.shard(out_ref, g, dim=2))}
        if backward:
            out.backward(layout.shard(dout, g, dim=2).to(dtype))
            for name, t, r in zip(("dq", "dk", "dv"), local, ref):
                errs[name] = rel_err(t.grad, layout.shard(r.grad, g, dim=2))
    finally:
        route_mod.copy_engine_ring = saved
    (engine,) = engines
    kv_local_bytes = sum(t.numel() * t.element_size() for t in local[1:])
    return {"errs": errs, "events": engine.events, "kv_bytes": kv_local_bytes,
            "grad_bytes": sum(t.numel() * 4 for t in local[1:]) if dtype != torch.float64 else kv_local_bytes}


@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16"])
@pytest.mark.parametrize("window", [None, (20, 0), (5, 0)], ids=["ring", "window", "short_window"])
def test_slots_are_sized_before_use(dtype_name, window):
    for r in run_ranks(2, ring_over_contract, dtype_name, True, window, timeout=120):
        events = r["events"]
        kinds = [e[1] for e in events if e[0] == "exchange"]
        assert "kv" in kinds and "grad" in kinds, events
        sized = {kind: max(e[2] for e in events if e[0] == "ensure" and e[1] == kind) for kind in ("kv", "grad")}
        assert sized["kv"] >= r["kv_bytes"] and sized["grad"] >= r["grad_bytes"], (sized, r)
        first_grad_use = next(i for i, e in enumerate(events) if e[0] == "buffers" and e[1] == "grad")
        assert any(e[0] == "ensure" and e[1] == "grad" for e in events[:first_grad_use]), events
        tol = 1e-10 if dtype_name == "float64" else 2e-2
        assert max(r["errs"].values()) < tol, r["errs"]


def test_forward_only_allocates_no_gradient_slots():
    for r in run_ranks(2, ring_over_contract, "float64", False, None, timeout=120):
        assert not any(e[1] == "grad" for e in r["events"]), r["events"]
        assert r["errs"]["out"] < 1e-10, r


# ---- the watchdog's view of the copy engines' GPU waits ---------------------------------------------
class FakeEvents:
    """Driver stand-in: an event is done once the test marks the point its stream reached."""

    def __init__(self):
        self.made, self.recorded, self.reached = 0, {}, set()

    def new_event(self):
        self.made += 1
        return self.made

    def record(self, event, stream):
        self.recorded[event] = stream
        self.reached.discard(event)  # re-recorded: not done until the stream gets there again

    def done(self, event):
        return event in self.reached


def test_wait_tracker_times_a_wait_from_when_the_gpu_reaches_it():
    from dtcp.comm.copy_engine import WaitTracker

    ev = FakeEvents()
    waits = WaitTracker(ev)
    with waits.tracked("compute", "kv data from rank 1"):
        pass
    before, after, _, _ = waits.pending[0]
    # The host enqueued the wait long ago but the GPU is still busy before it: no stall, however long.
    assert waits.stalled(30.0, now=0.0) is None
    assert waits.stalled(30.0, now=1000.0) is None
    # The GPU reaches the wait at t=1000 (first seen then) and sits in it.
    ev.reached.add(before)
    assert waits.stalled(30.0, now=1000.0) is None
    assert waits.stalled(30.0, now=1029.0) is None
    assert waits.stalled(30.0, now=1031.0) == "kv data from rank 1"
    # The data arrives: the wait is dropped and both events are recycled for the next wait.
    ev.reached.add(after)
    assert waits.stalled(30.0, now=1032.0) is None and waits.pending == []
    with waits.tracked("side", "rank 1 to free its kv slot"):
        pass
    assert ev.made == 2 and waits.pending[0][:2] in ([before, after], [after, before])
    assert waits.pending[0][0] not in ev.reached  # re-recorded events start not done


@pytest.mark.parametrize("v_head_dim", [16, 4])
def test_slots_hold_a_value_head_dim_of_its_own(v_head_dim):
    """V wider (or narrower) than K: the K/V and dK/dV slots are sized for K and V each (they
    were sized for two Ks, which a wider V overflows)."""
    for r in run_ranks(2, ring_over_contract, "bfloat16", True, None, v_head_dim, timeout=120):
        sized = {kind: max(e[2] for e in r["events"] if e[0] == "ensure" and e[1] == kind) for kind in ("kv", "grad")}
        assert sized["kv"] >= r["kv_bytes"] and sized["grad"] >= r["grad_bytes"], (sized, r)
        assert max(r["errs"].values()) < 2e-2, r["errs"]
