"""A kernel library's Python wrapper, called without its Python: each call signature is recorded
once and replayed after.

Why: FlashAttention-4's wrapper functions (flash_attn.cute.interface._flash_attn_fwd / _bwd) take
93-270 µs of host time a call on H200 hosts (argument checks, tile configs, compile keys,
allocations) around their compiled launches (benchmarks/bench_replay.py). A ring rank makes a
forward and a backward call a step, and at 8 ranks the host can bound the pass. Replayed, a
forward takes 39-83 µs and a backward 117-218 (its allocations and launches stay); a recording
costs 3-5x a wrapper call.

What such a wrapper does on the host is a function of what it is given on the host: the tensors'
shapes, strides, dtypes, devices, pointer alignment and requires_grad, and the plain values (ints,
floats, bools, strings, None). So for each signature of those, the wrapper runs under a recorder
once, and later calls replay what it did, on their own tensors:

  - every aten op it issued (an allocation, a fill, a copy), with where its tensor arguments came
    from: the call's arguments, an earlier op's outputs, or plain values;
  - every call of a compiled function it took out of its compile caches (each function named in
    `cache_owners` with a `compile_cache` attribute; the caches are swapped for recording views
    during the recorded call), with its arguments, in order.

Ops that make or write new tensors nothing uses are dropped (a write into the call's tensors, or
through a view of them, is kept), and views that only alias an argument (detach) too: a launch
is handed the tensor itself. Such a view is made by its op where it is returned and aliases the
call's own tensor, or where it differs from it in requires_grad and an op or the result takes it
(a view inherits requires_grad, under no_grad too). Uses count by memory: a write into a new
tensor is kept where it, its base or any view of that base is read later. tests/test_kernel_replay.py
checks random programs of allocations, views, in-place ops and launches against the wrapper.
A signature is never replayed (always called through the wrapper) where its recording saw the
wrapper read a tensor's value on the host (an op returning a non-tensor, such as .item()), hand a
launch or op a tensor of unknown origin (one cached across calls), give a launch an argument the
recorder cannot rebuild, or a tensor's address as a plain int. A signature's first call runs the wrapper unrecorded (it may compile
kernels), its second is recorded, and the later ones are replayed; a recording during which the
wrapper compiled after all is not kept, so compile-time work is never replayed.

A replay makes the same launches with the same arguments as the wrapper would: the same bits
(tests/test_kernel_replay.py on CPU with a wrapper of the same shape; tests/gpu on FA4).

What the recorder cannot see: a tensor's value read by .tolist() or .numpy(), which bypass the
dispatcher. A wrapper is replayed only where it was read for those (dtcp/kernels/fa4.py
REPLAY_CHECKED).

What the replay skips is the wrapper's own checks, so what is checked there is checked once per
signature. It also assumes the wrapper reads nothing else that changes between calls: environment
variables read at call time (FA4 reads a few debug switches) take effect for new signatures only.
`dtcp.config.kernel_replay = False` calls the wrapper every time.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from .._compat import (allocation_bindings, dispatch_mode_active, dispatch_mode_base, op_returns_views, op_writes,
                       tree_flatten, tree_unflatten)
from ..config import config

#: plain values a call or op may take as they were recorded (a value of another type: refused)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN_TYPES = frozenset(_PLAIN)  # (exact types: a recording's common case, without isinstance)

#: the most signatures a wrapper keeps (each a few µs of Python objects); beyond, the oldest go
MAX_SIGNATURES = 4096


_UNSEEN, _SEEN = object(), object()  # (a signature not called yet; called once)

#: one recording at a time in the process, whichever wrapper: each swaps the compile caches of its
#: library, and two at once would each restore the other's swap (a launch then goes unlogged)
_RECORDING = threading.RLock()


class _Ref:
    """A tensor in a replay: slot `i` of the replay's values (the call's tensors come first)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Refused(Exception):
    """The recording cannot be replayed (the message says why)."""


def signature(args: tuple, kwargs: dict):
    """(key, the call's tensors in order) for a call whose arguments are tensors and plain values,
    or (None, None) for anything else (nested containers, tensor subclasses such as fake tensors).
    A tensor's part of the key: shape, strides, dtype, device, requires_grad, its address modulo 32
    (wrappers copy or refuse tensors by alignment; FA4 checks up to 32 bytes) and which argument
    it is the same tensor as."""
    key, tensors, first = [tuple(kwargs), torch.is_grad_enabled()], [], {}
    for a in (*args, *kwargs.values()):
        if type(a) is torch.Tensor:
            # (the same tensor given twice is part of the signature: a replay reads it from one slot)
            key.append((a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.data_ptr() & 31,
                        first.setdefault(id(a), len(tensors))))
            tensors.append(a)
        elif isinstance(a, _PLAIN):
            key.append((type(a), a))
        else:
            return None, None
    return tuple(key), tensors


class _Step:
    """One recorded op or launch: `fn` called with its recorded arguments, the call's own tensors
    put in where the recording had them (`refs`: (position, slot) for positional arguments,
    (name, slot) for keyword ones), its new tensors kept in slots `outs`."""

    __slots__ = ("fn", "args", "kwargs", "arg_refs", "kw_refs", "outs", "single_out", "is_launch")

    def __init__(self, fn, args: list, kwargs: dict, outs, single_out, is_launch):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.arg_refs = [(j, a.i) for j, a in enumerate(args) if type(a) is _Ref]
        self.kw_refs = [(name, a.i) for name, a in kwargs.items() if type(a) is _Ref]
        self.outs, self.single_out, self.is_launch = outs, single_out, is_launch

    def run(self, values: list) -> None:
        args = self.args
        if self.arg_refs:
            args = list(args)
            for j, i in self.arg_refs:
                args[j] = values[i]
        kwargs = self.kwargs
        if self.kw_refs:
            kwargs = dict(kwargs)
            for name, i in self.kw_refs:
                kwargs[name] = values[i]
        got = self.fn(*args, **kwargs)
        if self.single_out:
            values[self.outs[0]] = got
        elif self.outs:
            for i, t in zip(self.outs, got):
                if i is not None:
                    values[i] = t


_ALLOCATORS: dict = {}


def _binding(func):
    """torch's own binding for allocation op `func` (the same schema: size or tensor, then dtype,
    layout, device, pin_memory, memory_format keywords), else the op itself."""
    if not _ALLOCATORS:
        # (an OpOverload called from Python parses its arguments against the schema, several µs
        # more a call than torch.empty's generated parser: a backward's eight allocations made its
        # replay slower than FA4's wrapper)
        _ALLOCATORS.update(allocation_bindings())
    return _ALLOCATORS.get(func, func)


class Program:
    """A recorded call: its steps, the number of value slots, and how its result is rebuilt."""

    def __init__(self, steps: list, slots: int, result_leaves: list, result_tree):
        self.steps, self.slots = steps, slots
        self.result_leaves, self.result_tree = result_leaves, result_tree
        self.launches = sum(s.is_launch for s in steps)

    def run(self, tensors: list):
        values = tensors + [None] * (self.slots - len(tensors))
        for step in self.steps:
            step.run(values)
        leaves = [values[x.i] if type(x) is _Ref else x for x in self.result_leaves]
        return tree_unflatten(leaves, self.result_tree)


class Replayed:
    """`fn` (a wrapper whose compiled launches come out of `compile_cache` attributes of the
    functions in `cache_owners()`), called through recordings (module docstring). Calling it
    takes fn's arguments and returns what fn returns.

    `stats` counts what happened: "first" (a signature's first call, through the wrapper),
    "recorded" (its second), "replayed", "refused" (calls through the wrapper for a signature it
    refused), "other" (calls whose arguments have no signature, under a dispatch mode, with the
    setting off, or `enabled` False: a wrapper not checked for replay). `refusals` keeps the last
    reasons, for tests and debugging."""

    def __init__(self, fn: Callable, cache_owners: Callable[[], list], name: str = "", enabled: bool = True):
        self.fn, self.cache_owners, self.name = fn, cache_owners, name or getattr(fn, "__name__", "fn")
        self.enabled = enabled
        self.programs: dict = {}
        self.stats = {"first": 0, "recorded": 0, "replayed": 0, "refused": 0, "other": 0}
        self.refusals: list[str] = []

    def __call__(self, *args, **kwargs):
        if not (self.enabled and config.kernel_replay) or dispatch_mode_active():
            # (under a dispatch mode, e.g. FakeTensorMode, the wrapper runs as it would: a replay
            # would bypass what the mode does with its Python)
            self.stats["other"] += 1
            return self.fn(*args, **kwargs)
        key, tensors = signature(args, kwargs)
        if key is None:
            self.stats["other"] += 1
            return self.fn(*args, **kwargs)
        program = self.programs.get(key, _UNSEEN)
        if type(program) is Program:
            self.stats["replayed"] += 1
            return program.run(tensors)
        if program is None:
            self.stats["refused"] += 1
            return self.fn(*args, **kwargs)
        if program is _UNSEEN:
            # A signature's first call goes through the wrapper unrecorded: it may compile, and a
            # compile is not run under the recorder. The second call records.
            self._put(key, _SEEN)
            self.stats["first"] += 1
            return self.fn(*args, **kwargs)
        return self._record(key, tensors, args, kwargs)

    def _put(self, key, value) -> None:
        with _RECORDING:  # (threads: simulated ranks share one process)
            if key not in self.programs and len(self.programs) >= MAX_SIGNATURES:
                del self.programs[next(iter(self.programs))]
            self.programs[key] = value

    def _record(self, key, tensors, args, kwargs):
        # One recording at a time: the caches are swapped process-wide (other threads' launches
        # pass through them unrecorded; their ops never reach this thread's dispatch mode).
        with _RECORDING:
            log: list = []
            mode = _Recorder(log)
            caches = _swap_caches(self.cache_owners(), log, mode)
            try:
                with mode:
                    result = self.fn(*args, **kwargs)
            finally:
                for owner, cache in caches:
                    owner.compile_cache = cache.inner
            if any(cache.compiled for _, cache in caches):
                return result  # (compiled during the call after all: the next call records)
            try:
                program = _build(log, tensors, result)
            except _Refused as why:
                program = None
                self.refusals = (self.refusals + [f"{self.name}: {why}"])[-16:]
            self._put(key, program)
            self.stats["recorded"] += 1
            return result


class _Recorder(dispatch_mode_base()):
    """Logs every aten op of the recording thread (not those inside a compiled launch, which the
    launch does itself: `paused`)."""

    def __init__(self, log: list):
        super().__init__()
        self.log, self.paused = log, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.log.append(("op", func, args, kwargs, out))
        return out


class _RecordingCache:
    """Stands for a compile cache during a recording: hands the recording thread its compiled
    functions wrapped to log their calls; notes a compile (an entry set)."""

    def __init__(self, inner, log: list, mode: _Recorder, thread: int):
        self.inner, self.log, self.mode, self.thread, self.compiled = inner, log, mode, thread, False

    def __getitem__(self, key):
        fn = self.inner[key]
        if threading.get_ident() != self.thread:
            return fn
        return _LoggedLaunch(fn, self.log, self.mode)

    def __setitem__(self, key, fn) -> None:
        if threading.get_ident() == self.thread:
            self.compiled = True
        self.inner[key] = fn

    def __contains__(self, key) -> bool:
        return key in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _LoggedLaunch:
    def __init__(self, fn, log: list, mode: _Recorder):
        self.fn, self.log, self.mode = fn, log, mode

    def __call__(self, *args, **kwargs):
        self.log.append(("launch", self.fn, args, kwargs, None))
        self.mode.paused = True
        try:
            got = self.fn(*args, **kwargs)
        finally:
            self.mode.paused = False
        if got is not None:
            self.log.append(("returned", None, None, None, got))
        return got


def _swap_caches(owners: list, log: list, mode: _Recorder) -> list:
    thread, swapped = threading.get_ident(), []
    for owner in owners:
        cache = _RecordingCache(owner.compile_cache, log, mode, thread)
        owner.compile_cache = cache
        swapped.append((owner, cache))
    return swapped


def _tensors_made(log: list) -> list:
    """The tensors the recorded ops returned."""
    made = []
    for kind, _, _, _, out in log:
        if kind == "op":
            made += [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if type(o) is torch.Tensor]
    return made


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


_OP_FACTS: dict = {}  # aten op -> (writes into an argument, may return a view of one)


def _op_facts(func) -> tuple:
    facts = _OP_FACTS.get(func)
    if facts is None:
        facts = _OP_FACTS[func] = (op_writes(func), op_returns_views(func))
    return facts


def _what(kind: str, fn) -> str:
    """What a refusal names: an op, a compiled launch, or `kind` itself ("the result"). Built only
    for a refusal: str() of an op costs µs, and a recording goes through every op's arguments."""
    if kind == "op":
        return str(fn)
    return f"a compiled launch ({type(fn).__name__})" if kind == "launch" else kind


def _build(log: list, tensors: list, result) -> Program:
    """The Program that replays `log` (one recorded call on `tensors`, which returned `result`)."""
    where: dict = {}  # id(tensor) -> slot
    keep = list(tensors)  # (the log holds the rest alive: ids stay unique while building)
    for i, t in enumerate(tensors):
        where.setdefault(id(t), i)
    slots = len(tensors)
    steps: list = []  # (_Step, slots it reads, slots it writes, mutates)
    fresh: set = set()  # slots of new tensors (allocations): the only memory a dropped write may hit
    # slot -> the slots whose memory it may share, where that is more than itself: a view's are
    # those of what it views (a write through a view changes its base, and the reverse)
    shares: dict = {}
    # every tensor's address in the call (its arguments, what its ops made): a launch taking one as
    # a plain int would replay the recorded call's memory
    addresses = {t.data_ptr() for t in tensors} | {o.data_ptr() for o in _tensors_made(log)}
    # the tensors the call returns (an alias among them may have to be made by its op: below)
    result_leaves_made, result_tree = tree_flatten(result)
    returned = {id(t) for t in result_leaves_made if isinstance(t, torch.Tensor)}
    n_args = len(tensors)
    # tensors a later op takes (not a launch: a compiled kernel reads memory, not autograd state)
    op_inputs = {id(t) for kind, _, args, kwargs, _ in log if kind == "op"
                 for a in (*args, *kwargs.values()) for t in (a if type(a) in (list, tuple) else (a,))
                 if isinstance(t, torch.Tensor)}

    def leaf(x, kind: str, fn):
        if isinstance(x, torch.Tensor):
            slot = where.get(id(x))
            if slot is None:
                raise _Refused(f"{_what(kind, fn)} takes a tensor {tuple(x.shape)} {x.dtype} that is neither an "
                               "argument of the call nor made in it (a tensor cached across calls)")
            return _Ref(slot)
        if isinstance(x, _PLAIN):
            return x
        raise _Refused(f"{_what(kind, fn)} takes a {type(x).__name__}, which a replay cannot rebuild")

    def argument(x, kind: str, fn):
        """An argument as the replay passes it: a _Ref for a tensor, else the recorded value,
        which must hold no tensor (a list of sizes, a tuple of Nones)."""
        t = type(x)
        if t in _PLAIN_TYPES:
            return x
        if t is list or t is tuple or t is torch.Size:
            if all(type(y) in _PLAIN_TYPES for y in x):  # (sizes, strides: the common case, no pytree)
                return x
        elif isinstance(x, torch.Tensor) or isinstance(x, _PLAIN):
            return leaf(x, kind, fn)
        leaves, _ = tree_flatten(x)
        for y in leaves:
            if isinstance(y, torch.Tensor):
                raise _Refused(f"{_what(kind, fn)} takes a {type(x).__name__} holding tensors, which a replay "
                               "cannot rebuild")
            leaf(y, kind, fn)
        return x

    for kind, fn, args, kwargs, out in log:
        if kind == "returned":
            raise _Refused(f"a compiled launch returned a {type(out).__name__} (a value the wrapper may use)")
        step_args = [argument(a, kind, fn) for a in args]
        step_kwargs = {name: argument(a, kind, fn) for name, a in kwargs.items()} if kwargs else {}
        refs = [a for a in step_args if type(a) is _Ref] + [a for a in step_kwargs.values() if type(a) is _Ref]
        reads = {a.i for a in refs}
        if kind == "launch":
            if any(type(a) is int and a > 4096 and a in addresses for a in (*args, *kwargs.values())):
                raise _Refused(f"{_what(kind, fn)} takes a tensor's address as an int, which a replay would pass again")
            steps.append((_Step(fn, step_args, step_kwargs, (), False, True), reads, reads, True))
            continue
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(o is None or type(o) is torch.Tensor for o in outs):
            raise _Refused(f"{fn} returned a {type(out).__name__} (the wrapper read a value on the host)")
        mutates, returns_views = _op_facts(fn)
        if not mutates and isinstance(out, torch.Tensor):
            alias = next((a.i for a in refs if _same_view(out, keep[a.i])), None)
            if alias is not None and (
                    (id(out) in returned and alias < n_args)
                    or (out.requires_grad != keep[alias].requires_grad
                        and (id(out) in returned or id(out) in op_inputs))):
                # (replayed: the op makes the tensor, as the wrapper did: a returned one is not the
                # call's own; one differing in requires_grad passes that on to what is made of it)
                alias = None
            if alias is not None:  # (detach, alias, a view to the same shape: the tensor itself)
                where.setdefault(id(out), alias)
                continue
        out_slots = []
        for o in outs:
            if o is None:
                out_slots.append(None)
            elif id(o) in where:  # (an in-place op returns its argument)
                out_slots.append(None)
            else:
                where[id(o)] = slots
                keep.append(o)
                out_slots.append(slots)
                slots += 1
        writes = {i for i in out_slots if i is not None} | (reads if mutates else set())
        if all(i is None for i in out_slots):  # (nothing new to keep: an in-place op, or no outputs)
            out_slots = []
        single = isinstance(out, torch.Tensor) and bool(out_slots)
        if not mutates:
            # new memory: an op whose outputs alias none of its arguments (an allocation, an
            # out-of-place op), or a view of new memory only
            if not returns_views or reads <= fresh:
                fresh.update(i for i in out_slots if i is not None)
            if returns_views and reads:
                memory = _memory_of(reads, shares)
                shares.update((i, memory) for i in out_slots if i is not None)
            if single:
                fn = _binding(fn)
        steps.append((_Step(fn, step_args, step_kwargs, tuple(out_slots), single, False), reads, writes, mutates))

    result_leaves = [leaf(x, "the result", None) for x in result_leaves_made]
    return Program(_live(steps, fresh, shares, result_leaves), slots, result_leaves, result_tree)


def _memory_of(slots, shares: dict) -> frozenset:
    """The slots whose memory `slots` may touch: each slot, or what it views (`shares`)."""
    memory = set()
    for i in slots:
        memory.update(shares.get(i, (i,)))
    return frozenset(memory)


def _live(steps: list, fresh: set, shares: dict, result_leaves: list) -> list:
    """The steps that matter: every launch, every op writing into memory that is not a new
    tensor's (the call's tensors, or a view of them), and the ops whose outputs those (or the
    result) read, transitively. The rest made or wrote new tensors that nothing uses. Reads and
    writes count by memory, not by slot: a write through a view is needed where its base (or
    another view of it) is read later, and a write into a base where a view of it is."""
    needed = set(_memory_of([leaf.i for leaf in result_leaves if type(leaf) is _Ref], shares))
    kept = []
    for step, reads, writes, mutates in reversed(steps):
        if step.is_launch or (mutates and not writes <= fresh) or (_memory_of(writes, shares) & needed):
            kept.append(step)
            needed |= _memory_of(reads, shares)
    return kept[::-1]


def fa4_cache_owners(module) -> Callable[[], list]:
    """The functions of a FlashAttention-4 interface module that hold compile caches (checked on
    flash-attn-4 4.0.0b36: _flash_attn_fwd, _flash_attn_bwd, _bwd_preprocess,
    _bwd_postprocess_convert, _compute_tile_cumsum, ...), looked up once."""
    owners: Optional[list] = None

    def get() -> list:
        nonlocal owners
        if owners is None:
            owners = [f for f in vars(module).values() if callable(f) and hasattr(f, "compile_cache")]
        return owners
    return get
