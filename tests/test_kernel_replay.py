"""dtcp/kernels/replay.py on CPU: a wrapper shaped like FlashAttention-4's (checks and allocations
in Python around "compiled" launches taken out of compile caches), called through Replayed.

The launches here are Python callables that write into their arguments, as compiled kernels do;
what is checked is that a replay gives the wrapper's results bit for bit on new values, skips the
wrapper's Python, and refuses what it cannot replay. FA4 itself: tests/gpu/test_one_gpu_ranks.py.
"""

import threading
from typing import NamedTuple, Optional

import pytest
import torch

from dtcp.config import config
from dtcp.kernels.replay import Program, Replayed, signature


class Aux(NamedTuple):  # (FA4 passes such a tuple to its launches)
    tensors: Optional[list]
    scalars: Optional[tuple]


class _Forward:
    """A "compiled" forward: out = softmax(scale * q k^T) v per sequence (cu: int32 bounds), lse;
    acc is scratch the wrapper zeroes and the launch adds into."""

    def __call__(self, q, k, v, out, lse, acc, scale, cu, window, aux):
        assert aux.tensors is None
        bounds = [0, q.shape[0]] if cu is None else cu.tolist()  # (a launch reads what it likes)
        for a, b in zip(bounds, bounds[1:]):
            s = (q[a:b] @ k[a:b].transpose(0, 1)) * scale
            if window is not None:
                i = torch.arange(b - a)
                s = s.masked_fill((i[:, None] - i[None, :]) > window, float("-inf"))
            lse[a:b] = torch.logsumexp(s, -1)
            out[a:b] = torch.softmax(s, -1) @ v[a:b]
        acc.add_(out.sum(0))


class _Finish:
    """A second "compiled" launch (as FA4's postprocess): out *= 1 + acc.mean() * 0."""

    def __call__(self, out, acc, unit):
        out.mul_(unit + acc.mean() * 0.0)


class _ByAddress(_Forward):
    """A launch that also takes an address as an int (as a kernel given raw pointers would)."""

    def __call__(self, q, k, v, out, lse, acc, scale, cu, window, aux, address=0):
        super().__call__(q, k, v, out, lse, acc, scale, cu, window, aux)


def make_wrapper(read_value=False, cached_tensor=None, returns=False, by_address=False):
    """A wrapper with FA4's shape: checks, allocations, a detached view, a zeroed scratch, two
    launches out of two compile caches; `python` counts the runs of its Python."""
    runs = {"python": 0}

    def finish(out, acc):
        key = (out.dtype,)
        if key not in finish.compile_cache:
            finish.compile_cache[key] = _Finish()
        finish.compile_cache[key](out, acc, 1.0)

    def wrapper(q, k, v, scale, cu=None, out=None, window=None):
        runs["python"] += 1
        assert q.shape == k.shape == v.shape and q.dtype == k.dtype
        if q.data_ptr() % 16:  # (a wrapper copying a tensor it finds misaligned)
            q = q.clone()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        lse = torch.empty(q.shape[0], dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
        acc = torch.zeros(q.shape[-1], dtype=q.dtype)
        unused = torch.ones(7)  # noqa: F841  (made and never used: a replay drops it)
        if read_value and cu is not None and int(cu[-1]) != q.shape[0]:
            raise ValueError("cu")
        if q.shape[0] == 0:
            out.zero_()
        key = (q.dtype, q.shape[-1], window is None, cu is None)
        if key not in wrapper.compile_cache:
            wrapper.compile_cache[key] = _ByAddress() if by_address else _Forward()
        launch = wrapper.compile_cache[key]
        extra = dict(address=out.data_ptr()) if by_address else {}
        got = launch(q.detach(), k, v, out, lse, cached_tensor if cached_tensor is not None else acc, scale, cu,
                     window, Aux(None, None), **extra)
        if returns:
            launch.__class__ = _Returning
        finish(out, acc)
        return out, lse, None

    wrapper.compile_cache = {}
    finish.compile_cache = {}
    owners = lambda: [wrapper, finish]  # noqa: E731
    return wrapper, owners, runs


class _Returning(_Forward):
    def __call__(self, *args):
        super().__call__(*args)
        return 1


def _inputs(seed, n=12, d=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=dtype) for _ in range(3)]


def _same(a, b):
    return all(x is None and y is None or torch.equal(x, y) for x, y in zip(a, b))


def test_a_replay_gives_the_wrappers_bits_on_new_values_without_its_python():
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners, "toy")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for seed in range(6):
        q, k, v = _inputs(seed)
        cu_now = torch.tensor([0, 3 + seed, 12], dtype=torch.int32)  # new values, same signature
        got = fast(q, k, v, 0.5, cu=cu_now, window=2)
        want = wrapper(q, k, v, 0.5, cu=cu_now, window=2)
        assert _same(got, want)
        assert got[0].abs().sum() > 0 and torch.isfinite(got[1]).all()
    # call 1 through the wrapper (it compiles), call 2 recorded, calls 3-6 replayed; plus 6 direct calls
    assert fast.stats == {"first": 1, "recorded": 1, "replayed": 4, "refused": 0, "other": 0}
    assert runs["python"] == 2 + 6
    program = next(iter(fast.programs.values()))
    assert program.launches == 2
    ops = [str(s.fn) for s in program.steps if not s.is_launch]
    # kept: q's, lse's and acc's allocations and acc's zero fill; dropped: the unused ones, the detach
    assert not any("ones" in op or "detach" in op for op in ops), ops
    assert sum("empty" in op for op in ops) == 2 and sum("zero" in op for op in ops) == 1, ops
    del cu


def test_a_replay_writes_into_the_given_output_and_returns_it():
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    big = torch.zeros(3, 12, 4, dtype=torch.float64)
    for seed in range(4):
        q, k, v = _inputs(seed)
        out = big[1]
        got = fast(q, k, v, 0.25, out=out)
        assert got[0] is out
        want = wrapper(q, k, v, 0.25)
        assert torch.equal(out, want[0]) and torch.equal(got[1], want[1])
    assert fast.stats["replayed"] == 2


def test_a_new_signature_records_again():
    """Shape, dtype, requires_grad, alignment, a plain value's type and the same tensor given
    twice each make a new signature; each is replayed right."""
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    q, k, v = _inputs(0)
    base = signature((q, k, v, 0.5), {})[0]
    assert signature((q, k, v, 0.5), {})[0] == base
    variants = [
        ((q[:8], k[:8], v[:8], 0.5), {}),
        ((q.float(), k.float(), v.float(), 0.5), {}),
        ((q.clone().requires_grad_(), k, v, 0.5), {}),
        ((torch.randn(49, dtype=torch.float64)[1:].view(12, 4), k, v, 0.5), {}),  # 8 bytes off
        ((q, k, v, 1), {}),
        ((q, k, k, 0.5), {}),
        ((q, k, v, 0.5), {"window": 1}),
    ]
    keys = {signature(a, kw)[0] for a, kw in variants}
    assert len(keys) == len(variants) and base not in keys
    for args, kw in variants:
        for _ in range(3):
            with torch.no_grad():
                got, want = fast(*args, **kw), wrapper(*args, **kw)
            assert _same(got, want)
    assert fast.stats["recorded"] == len(variants) and fast.stats["replayed"] == len(variants)
    # the same tensor twice, recorded so, and replayed with it twice again
    q2, k2, _ = _inputs(9)
    assert _same(fast(q2, k2, k2, 0.5), wrapper(q2, k2, k2, 0.5))


def test_an_empty_input_replays_the_wrappers_fill_of_the_given_output():
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    e = torch.empty(0, 4, dtype=torch.float64)
    for _ in range(3):
        out = torch.full((0, 4), 3.0, dtype=torch.float64)
        got = fast(e, e, e, 0.5, out=out)
        assert got[0] is out
    assert fast.stats["replayed"] == 1


@pytest.mark.parametrize("case", ["read_value", "cached_tensor", "returns", "by_address"])
def test_what_a_replay_cannot_rebuild_is_refused_and_called_through_the_wrapper(case):
    kwargs = {"read_value": dict(read_value=True), "cached_tensor": dict(cached_tensor=torch.zeros(4, dtype=torch.float64)),
              "returns": dict(returns=True), "by_address": dict(by_address=True)}[case]
    wrapper, owners, runs = make_wrapper(**kwargs)
    fast = Replayed(wrapper, owners)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    for seed in range(4):
        q, k, v = _inputs(seed)
        got = fast(q, k, v, 0.5, cu=cu)
        want = wrapper(q, k, v, 0.5, cu=cu)
        assert _same(got, want)
    assert fast.stats["replayed"] == 0 and fast.stats["refused"] == 2, fast.stats
    assert len(fast.refusals) == 1
    assert {"read_value": "returned a", "cached_tensor": "neither an argument", "returns": "launch returned",
            "by_address": "address as an int"}[case] in fast.refusals[0]


def test_arguments_without_a_signature_and_the_setting_off_call_the_wrapper():
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    q, k, v = _inputs(0)
    assert signature((q, k, v, [1, 2]), {}) == (None, None)
    with config.override(kernel_replay=False):
        for _ in range(3):
            assert _same(fast(q, k, v, 0.5), wrapper(q, k, v, 0.5))
    assert fast.stats == {"first": 0, "recorded": 0, "replayed": 0, "refused": 0, "other": 3}
    off = Replayed(wrapper, owners, enabled=False)
    for _ in range(3):
        off(q, k, v, 0.5)
    assert off.stats["other"] == 3 and not off.programs


def test_another_threads_launches_during_a_recording_are_not_recorded():
    """The caches are swapped process-wide while one thread records: a launch another thread
    takes out of them then runs unrecorded (and a replay does not repeat it)."""
    wrapper, owners, runs = make_wrapper()
    hits = []

    def other_thread():
        launch = wrapper.compile_cache[next(iter(wrapper.compile_cache))]
        hits.append(type(launch).__name__)

    def with_a_thread(*args, **kwargs):
        got = wrapper(*args, **kwargs)
        if wrapper.compile_cache:
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        return got

    fast = Replayed(with_a_thread, owners)
    for seed in range(3):
        q, k, v = _inputs(seed)
        assert _same(fast(q, k, v, 0.5), wrapper(q, k, v, 0.5))
    assert hits == ["_Forward", "_Forward"]  # the bare launch, in the compiling and the recording call
    assert next(iter(fast.programs.values())).launches == 2


def test_a_wrapper_that_raises_while_recording_leaves_the_caches_as_they_were():
    wrapper, owners, runs = make_wrapper()
    finish = owners()[1]
    fast = Replayed(wrapper, owners)
    q, k, v = _inputs(0)
    fast(q, k, v, 0.5)  # compiles
    for _ in range(2):  # (the second call of a signature is the one recorded)
        with pytest.raises(AssertionError):
            fast(q, k[:5], v, 0.5)
    assert type(wrapper.compile_cache) is dict and type(finish.compile_cache) is dict
    assert not any(type(p) is Program for p in fast.programs.values())
    for _ in range(3):
        assert _same(fast(q, k, v, 0.5), wrapper(q, k, v, 0.5))
    assert fast.stats["replayed"] == 2


def test_allocations_replay_through_torchs_bindings_as_the_ops_would():
    """The allocation ops a wrapper's recording holds run through torch's bindings (torch.empty and
    the like, faster than the OpOverload from Python): with the arguments the dispatcher records,
    each binding gives what the op gives (shape, strides, dtype, device; the fills' values)."""
    from dtcp.kernels.replay import _Recorder, _binding

    like = torch.randn(3, 5, dtype=torch.float64).transpose(0, 1)
    makers = [lambda: torch.empty(4, 6, dtype=torch.float32), lambda: torch.empty(2, 3, 4),
              lambda: torch.zeros(7, 2, dtype=torch.int32), lambda: torch.empty_like(like),
              lambda: torch.empty_like(like, dtype=torch.float32, memory_format=torch.contiguous_format),
              lambda: torch.zeros_like(like), lambda: torch.empty_strided((3, 4), (1, 3)),
              lambda: torch.full((2, 3), 1.5, dtype=torch.float64),
              lambda: torch.empty(5, dtype=torch.bfloat16, memory_format=torch.contiguous_format)]
    fast = 0
    for make in makers:
        log = []
        with _Recorder(log):
            want = make()
        kind, func, args, kwargs, out = log[0]  # (the factories' Python binding detaches the op's output after)
        assert out.data_ptr() == want.data_ptr()
        binding = _binding(func)
        fast += binding is not func
        got = binding(*args, **kwargs)
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)
        if "zeros" in str(func) or "full" in str(func):
            assert torch.equal(got, want)
    assert fast == len(makers)


def test_under_a_dispatch_mode_the_wrapper_runs_as_it_would():
    """Under a TorchDispatchMode (FakeTensorMode, a FLOP counter) every call goes through the
    wrapper, which the mode then sees whole; outside it, the same signature replays."""
    from dtcp.kernels.replay import _Recorder

    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    q, k, v = _inputs(0)
    for _ in range(3):
        fast(q, k, v, 0.5)
    seen: list = []
    with _Recorder(seen):
        got = fast(q, k, v, 0.5)
    assert fast.stats["other"] == 1 and fast.stats["replayed"] == 1
    assert any("ones" in str(entry[1]) for entry in seen)  # (the wrapper's own Python ran)
    assert _same(got, wrapper(q, k, v, 0.5))


def test_two_wrappers_recording_from_two_threads_take_turns():
    """Two wrappers over one library's caches (FA4's forward and backward), recorded from two
    threads at once: the second waits for the first (each recording swaps the caches; two at once
    would each restore the other's swap), both programs hold their launches, the caches end as
    they were."""
    import time

    wrapper, owners, runs = make_wrapper()
    finish = owners()[1]
    other = Replayed(lambda *a, **k: wrapper(*a, **k), owners, "other")
    q, k, v = _inputs(0)
    started = []

    def record_the_other():
        other(q, k, v, 0.5)
        other(q, k, v, 0.5)  # (its recording: waits until the first thread's is done)

    def hooked(*args, **kwargs):
        if started == ["go"]:
            t = threading.Thread(target=record_the_other)
            t.start()
            started.append(t)
            time.sleep(0.2)  # (the other thread reaches its recording meanwhile)
        return wrapper(*args, **kwargs)

    fast = Replayed(hooked, owners, "first")
    fast(q, k, v, 0.5)
    started.append("go")
    fast(q, k, v, 0.5)  # recorded, with the other thread started inside
    started[1].join()
    assert type(wrapper.compile_cache) is dict and type(finish.compile_cache) is dict
    for w in (fast, other):
        (program,) = [p for p in w.programs.values() if type(p) is Program]
        assert program.launches == 2, w.name
        q2, k2, v2 = _inputs(3)
        assert _same(w(q2, k2, v2, 0.5), wrapper(q2, k2, v2, 0.5))


def test_the_oldest_signatures_go_beyond_the_limit(monkeypatch):
    import dtcp.kernels.replay as replay_mod

    monkeypatch.setattr(replay_mod, "MAX_SIGNATURES", 2)
    wrapper, owners, runs = make_wrapper()
    fast = Replayed(wrapper, owners)
    for n in (4, 5, 6, 4):
        for _ in range(3):
            q, k, v = _inputs(n, n=n)
            assert _same(fast(q, k, v, 0.5), wrapper(q, k, v, 0.5))
    assert len(fast.programs) == 2
    assert fast.stats["recorded"] == 4  # (n = 4 was recorded again after it went)


# ---- the ring's own FA4 calls, replayed: dtcp's fa4 kernel over a CPU stand-in of FA4's interface ----
def _compiled_fa4():
    """tests/test_kernels_optional.py's FakeFa4 (FA4's interface in float64 on CPU) shaped like
    FA4's: each wrapper checks and allocates in Python and takes its "compiled launch" (FakeFa4's
    computation, writing into the outputs) out of a compile cache."""
    from test_kernels_optional import FakeFa4

    fake = FakeFa4()

    def _launch(compute, self):
        def launch(*args, **kwargs):  # (writes into its arguments and returns nothing, as a launch)
            compute(self, *args, **kwargs)
        return launch

    def _flash_attn_fwd(q, k, v, out=None, lse=None, **kw):
        varlen = kw.get("cu_seqlens_q") is not None
        if out is None:
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        if lse is None:
            lse = torch.empty((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]),
                              dtype=torch.float32)
        key = (q.dtype, varlen)
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = _launch(FakeFa4._flash_attn_fwd, fake)
        _flash_attn_fwd.compile_cache[key](q, k, v, out=out, lse=lse, **kw)
        return out, lse, None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, dq=None, dk=None, dv=None, **kw):
        dq = torch.empty_like(q) if dq is None else dq
        dk, dv = torch.empty_like(k) if dk is None else dk, torch.empty_like(v) if dv is None else dv
        key = (q.dtype, kw.get("cu_seqlens_q") is None)
        if key not in _flash_attn_bwd.compile_cache:
            _flash_attn_bwd.compile_cache[key] = _launch(FakeFa4._flash_attn_bwd, fake)
        _flash_attn_bwd.compile_cache[key](q, k, v, out, dout, lse, dq=dq, dk=dk, dv=dv, **kw)
        return dq, dk, dv

    _flash_attn_fwd.compile_cache, _flash_attn_bwd.compile_cache = {}, {}
    fake._flash_attn_fwd, fake._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return fake


def install_compiled_fa4(monkeypatch) -> None:
    """dtcp's fa4 kernel over `_compiled_fa4()`, replayed as a checked release would be, with no
    replay wrappers left from another test."""
    from dtcp.kernels import fa4 as fa4_mod

    monkeypatch.setattr(fa4_mod, "_IMPORT", (_compiled_fa4(), None))
    monkeypatch.setattr(fa4_mod, "_REPLAYED", {})
    monkeypatch.setattr(fa4_mod, "_release", lambda: fa4_mod.REPLAY_CHECKED[0])


@pytest.mark.parametrize("layout_name", ["balanced", "zigzag"])
def test_the_rings_fa4_calls_replay_to_the_same_bits_batch_after_batch(layout_name, monkeypatch):
    """4 simulated ranks (tests/sim_ranks.py) run dtcp's fa4 kernel over the stand-in, as a model
    would: three batches, each with a new document structure (new signatures for most launches)
    and three layers of new values (buffers rewritten); each layer with the wrapper called every
    time and replayed: the same bits (CPU), and every signature replayed from its third call."""
    import dtcp
    from dtcp.kernels import KERNELS
    from dtcp.kernels import fa4 as fa4_mod
    from sim_ranks import simulated_ring

    install_compiled_fa4(monkeypatch)
    kernel, n, s = KERNELS["fa4"], 4, 256
    g = torch.Generator().manual_seed(11)
    for batch in range(3):
        cuts = sorted(torch.randperm(s // 8 - 1, generator=g)[:5].add(1).mul(8).tolist())
        docs = tuple(b - a for a, b in zip([0] + cuts, cuts + [s]))
        layout = dtcp.Balanced(docs, min_chunk=8) if layout_name == "balanced" else dtcp.Zigzag()
        for layer in range(3):
            # (float32: the ring's accumulators are then float32, as FA4's lse; with float64 inputs the
            # ring hands its float64 lse to the kernel)
            q, k, v, dout = (torch.randn(1, h, s, 16, generator=g, dtype=torch.float32) for h in (4, 2, 2, 4))
            with dtcp.config.override(kernel_replay=False):
                want = simulated_ring(layout, n, q, k, v, dout, kernel, window=(-1, 0), docs=docs, scale=0.25)
            got = simulated_ring(layout, n, q, k, v, dout, kernel, window=(-1, 0), docs=docs, scale=0.25)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), (layout_name, batch, layer, name)
    for which in ("fwd", "bwd"):
        stats = fa4_mod.replayed(which).stats
        assert stats["refused"] == 0 and stats["replayed"] >= stats["recorded"] > 0, (which, stats)
        assert stats["first"] == stats["recorded"], (which, stats)  # (each signature called >= 2 times)


def test_an_in_place_op_through_a_view_of_an_argument_is_replayed():
    """A write into the caller's tensor through a view of it (a slot of its own in the replay)
    is kept, though nothing reads that view afterwards."""
    def wrapper(x, value):
        x.view(-1)[:2].fill_(value)
        torch.zeros(3).view(-1)[:1].fill_(value)  # (a write into a tensor nothing uses: dropped)
        return x

    wrapper.compile_cache = {}
    fast = Replayed(wrapper, lambda: [wrapper])
    for _ in range(4):
        x = torch.zeros(3, 4)
        assert fast(x, 2.0) is x
        assert x.view(-1)[:2].eq(2.0).all() and x.view(-1)[2:].eq(0.0).all()
    assert fast.stats["replayed"] == 2
    program = next(p for p in fast.programs.values() if type(p) is Program)
    assert sum("fill_" in str(s.fn) for s in program.steps) == 1


@pytest.mark.parametrize("returned", ["base", "view"])
def test_a_write_into_new_memory_counts_for_every_view_of_it(returned):
    """A write through a view of a new tensor whose base is returned, and a write into a new base
    a view of which (made before the write) is returned: both are kept (each was dropped as a
    write into memory nothing read, and the replay returned the allocation's bare values)."""
    def wrapper(x):
        t = torch.zeros(3, 4)
        view = t.transpose(0, 1)
        if returned == "base":
            t.view(-1)[:5].add_(x.sum())
            return t
        t.add_(x.sum())
        return view

    wrapper.compile_cache = {}
    fast = Replayed(wrapper, lambda: [wrapper])
    for i in range(4):
        x = torch.full((2,), float(i + 1))
        assert torch.equal(fast(x.clone()), wrapper(x.clone())), i
    assert fast.stats["replayed"] == 2


class _Mix:
    """A random "compiled" launch: dst = dst * 0.5 + a.sum() * c + b.mean() (in place)."""

    def __call__(self, a, b, dst, c):
        dst.mul_(0.5).add_(a.sum() * c + b.mean())


def _random_wrapper(seed: int):
    """A wrapper of random steps over a pool of tensors (the call's x, y and out first): new
    tensors (zeros, clones), views (transpose, slice, unsqueeze, select, flatten, detach),
    in-place ops (add_, copy_ between tensors of one shape, mul out=) and launches (into any
    tensor, the call's too), returning a random few of them. What the replay must reproduce
    whatever it drops."""
    g = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(0, n, (1,), generator=g))

    program, pool_size = [], 3
    for _ in range(4 + pick(16)):
        kind = pick(11)
        program.append((kind, pick(pool_size), pick(pool_size), float(pick(5))))
        pool_size += kind in (0, 1, 2, 3, 6, 8, 9)  # (the kinds that add a tensor to the pool)
    returned = sorted({pick(pool_size) for _ in range(1 + pick(3))})

    def wrapper(x, y, out):
        pool = [x, y, out]
        for kind, i, j, c in program:
            t, other = pool[i], pool[j]
            same_shape = other.shape == t.shape and other.data_ptr() != t.data_ptr()
            if kind == 0:
                pool.append(torch.zeros(3, 4, dtype=torch.float64))
            elif kind == 1:
                pool.append(t.transpose(0, 1) if t.dim() == 2 else t.detach())
            elif kind == 2:
                pool.append(t[1:] if t.dim() >= 1 and t.shape[0] > 1 else t.detach())
            elif kind == 3:
                pool.append(t.unsqueeze(0) if t.dim() < 3 else t.detach())
            elif kind == 4:
                t.add_(c)
            elif kind == 5 and same_shape:
                other.copy_(t)
            elif kind == 6:
                pool.append(t.clone())
            elif kind == 7 and same_shape:
                torch.mul(t, c, out=other)
            elif kind == 8:
                pool.append(t[0] if t.dim() >= 1 and t.shape[0] > 0 else t.detach())
            elif kind == 9:
                pool.append(t.reshape(-1))
            elif kind == 10:
                wrapper.compile_cache["mix"](t, other, t, c)
        return tuple(pool[i] for i in returned)

    wrapper.compile_cache = {"mix": _Mix()}
    return wrapper


@pytest.mark.parametrize("seed", range(200))
def test_random_wrappers_replay_to_the_wrappers_bits(seed):
    """Random programs of allocations, views, in-place and out-of-place ops and launches: the
    replay returns what the wrapper returns (values, requires_grad, and which of them are the
    call's own tensors) and leaves the call's tensors as the wrapper does, on new values every
    call, whatever steps its dead-op pass dropped. Odd seeds: the call's tensors require grad
    (called under no_grad, as dtcp's autograd functions call FA4)."""
    wrapper = _random_wrapper(seed)
    fast = Replayed(wrapper, lambda: [wrapper])
    g = torch.Generator().manual_seed(1000 + seed)
    grad = seed % 2 == 1
    for call in range(5):
        inputs = [torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(3)]
        want_inputs = [t.detach().clone().requires_grad_(grad) for t in inputs]
        with torch.no_grad():
            want = wrapper(*want_inputs)
            got = fast(*inputs)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (seed, call)
            assert a.requires_grad == b.requires_grad, (seed, call)
            assert [a is t for t in inputs] == [b is t for t in want_inputs], (seed, call)
        for a, b in zip(inputs, want_inputs):
            assert torch.equal(a, b), (seed, call, "the call's tensors")
    assert fast.stats["replayed"] == 3 and fast.stats["refused"] == 0, fast.stats


def test_a_returned_detached_argument_is_its_own_tensor():
    """The wrapper returns detached views of its arguments: the replay returns new detached views
    too, not the arguments themselves (which would require grad, and be the caller's objects)."""
    def wrapper(x, y):
        return x.detach(), y.detach(), x

    wrapper.compile_cache = {}
    fast = Replayed(wrapper, lambda: [wrapper])
    for _ in range(4):
        x, y = torch.randn(3, requires_grad=True), torch.randn(3)
        with torch.no_grad():
            a, b, c = fast(x, y)
        assert a is not x and not a.requires_grad and a.data_ptr() == x.data_ptr()
        assert b is not y and b.data_ptr() == y.data_ptr() and c is x
    assert fast.stats["replayed"] == 2


def test_a_view_of_a_detached_argument_does_not_require_grad():
    """The wrapper returns a view of a detached argument (an internal alias): the replay's view
    is made of the detached tensor too, so it does not require grad where the wrapper's does not
    (a view of the argument itself would, under no_grad as with grad)."""
    def wrapper(x):
        return (x.detach().unsqueeze(0),)

    wrapper.compile_cache = {}
    fast = Replayed(wrapper, lambda: [wrapper])
    for _ in range(4):
        x = torch.randn(3, requires_grad=True)
        with torch.no_grad():
            (got,) = fast(x)
        assert not got.requires_grad and got.data_ptr() == x.data_ptr()
    assert fast.stats["replayed"] == 2
