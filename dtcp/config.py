"""dtcp's settings: one object, `dtcp.config`.

Every switch dtcp has lives here. Environment variables are read once, when dtcp is imported;
nothing reads the environment or a module global on the hot path.

    import dtcp
    dtcp.config.timeout_s = 120                 # a setting for the rest of the process
    with dtcp.config.override(eager_fast_path=False):
        ...                                      # a setting for a block (tests, benchmarks)

| setting | default | environment variable | what it does |
|---|---|---|---|
| `timeout_s` | 30.0 | `DTCP_TIMEOUT` | longest wait for another rank inside a dtcp call, then every rank raises |
| `check_every_call` | False | `DTCP_CHECK_EVERY_CALL` | agree on the call's arguments on every call, not only on a new route (debug) |
| `transport` | "auto" | `DTCP_TRANSPORT` | ring transport on CUDA: "auto" (copy engines where available), "ce", "nccl" |
| `high_priority_ring` | True | `DTCP_HIGH_PRIORITY_RING` | NCCL ring on a high-priority stream |
| `merge` | "auto" | `DTCP_MERGE` | LSE merge, and the all-gather's dK/dV sum (exec/rowsum.py): "auto" (fused Triton kernels on CUDA), "triton", "torch" |
| `merge_slots_bytes` | 512 MiB | `DTCP_MERGE_SLOTS_BYTES` | where a ring pass's first launch writes the results, its later launches write their outputs (forward) and dQ (backward) into slots of at most this many bytes a pass, merged (summed) once at the end instead of launch by launch through float32 accumulators (dtcp/exec/fused.py `Slots`); a pass needing more, and 0, merge launch by launch |
| `allgather_exchange` | True | `DTCP_ALLGATHER_EXCHANGE` | the all-gather's one varlen launch over documents moves only the keys other ranks read (and their dK/dV back: one all-to-all each way, plan.KeyExchange), nothing where every document sits on one rank; False: every rank's whole shard to every rank (an all-gather and a reduce-scatter) |
| `allgather_max_bytes` | 16 MiB | | `strategy="auto"` on CPU, and the exchange across hybrid groups, gather K/V up to this size (whole sequence, per rank) |
| `cost_machine` | None | | the cost model's constants (a `dtcp.plan.Machine`, e.g. from `dtcp.calibrate()`); None: the shipped H200 NVLink figures |
| `cost_objective` | "auto" | `DTCP_COST_OBJECTIVE` | what `strategy="auto"` minimizes: "call" (an isolated call's time, the host's time to queue it included), "device" (its device time alone), "step" (its share of a training step: the larger of its device time and the host time that the rest of its layer, `layer_flops_per_token`, does not cover), or "auto" ("step" where `layer_flops_per_token` is set, else "call") |
| `layer_flops_per_token` | None | `DTCP_LAYER_FLOPS_PER_TOKEN` | the device FLOPs per token of the rest of the layer around each attention call, forward + backward (6 x the layer's matmul parameters): what the "step" objective weighs the call's host time against. The Trainer, HF and torchtitan integrations set it from the model's config inside their blocks when unset |
| `auto_placement` | "ring" | `DTCP_AUTO_PLACEMENT` | what `layout="auto"` places a packed batch for: "ring", `Balanced`'s placement (its ring steps weighed against the work they save); "fastest", also the placement balancing the work alone (`Balanced(min_chunk=256, hidden_steps=N)`), taken where the strategy the cost model picks on it is predicted at least 10% faster than its pick on the ring's (needs `attention_heads`; dtcp.api.placed_for_the_fastest_strategy). "ring" stays the default until "fastest" is measured on GPUs |
| `attention_heads` | None | `DTCP_ATTENTION_HEADS` | (query heads, key/value heads, head dim) of the model's attention calls, e.g. `(32, 8, 128)` (`"32,8,128"`): the calls `auto_placement="fastest"` predicts. The Trainer, HF and torchtitan integrations set it from the model's config inside their blocks when unset |
| `eager_fast_path` | True | | plain eager calls skip the custom op (same results, less host time) |
| `traced_allgather` | True | | compiled calls trace the all-gather schedule into the graph where it applies |
| `one_launch` | True | | ... and run a zigzag rank's tasks as one varlen flash launch |
| `ring_one_launch` | True | | a ring step's tasks (document pieces, chunk pairs, diagonal and off-diagonal blocks) as one varlen launch per window where the kernel has one (fa4, flash) |
| `varlen_gaps` | True | | ... and a launch whose rows or keys lie apart (in order) reads them in place, leaving the rows between out (FA4's seqused), instead of gathering them |
| `kernel_replay` | True | `DTCP_KERNEL_REPLAY` | FlashAttention-4's Python wrapper runs on a call signature's first two calls (shapes, strides, dtypes, alignment, plain values; the second recorded); later calls replay its allocations and compiled launches without it (dtcp/kernels/replay.py; two H200 hosts: 55-110 µs less a forward call, 20-55 µs less a backward call; a recording costs 3-5x a wrapper call) |
| `ring_steps_per_launch` | 1 | `DTCP_RING_STEPS_PER_LAUNCH` | G > 1: the ring's received blocks in groups of G, each block straight from its home rank (the keys its receiver uses) and each group one or two launches where the kernel has one-launch steps (dtcp/exec/grouped.py); "auto": G per call from the cost model (groups only where it predicts them 10% faster than G = 1) |
| `ring_groups_in_place` | True | | ... and a group whose launches can read its received blocks in place (at most two launches, no key in two of them: a causal zigzag rank's) receives them into one buffer, one block after another, and its launches read it and write their dK/dV shares as they are, without packing copies (plan/group.py `InPlaceGroup`); False: every group packed into one launch |
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Optional, Union

_CHOICES = {
    "transport": ("auto", "ce", "nccl"),
    "merge": ("auto", "triton", "torch"),
    "cost_objective": ("auto", "call", "device", "step"),
    "auto_placement": ("ring", "fastest"),
}


def _parse_bool(value: str) -> bool:
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("use 1 or 0")


def _parse_steps(value: str) -> Union[int, str]:
    value = value.strip().lower()
    return value if value == "auto" else int(value)


def _parse_choice(value: str) -> str:
    return value.strip().lower()


def _parse_ints(value: str) -> tuple:
    return tuple(int(x) for x in value.replace(" ", "").split(","))


#: (environment variable, setting, parser): read once, by Config.from_env
_ENVIRONMENT = (
    ("DTCP_TIMEOUT", "timeout_s", float),
    ("DTCP_CHECK_EVERY_CALL", "check_every_call", _parse_bool),
    ("DTCP_TRANSPORT", "transport", _parse_choice),
    ("DTCP_HIGH_PRIORITY_RING", "high_priority_ring", _parse_bool),
    ("DTCP_MERGE", "merge", _parse_choice),
    ("DTCP_MERGE_SLOTS_BYTES", "merge_slots_bytes", int),
    ("DTCP_COST_OBJECTIVE", "cost_objective", _parse_choice),
    ("DTCP_LAYER_FLOPS_PER_TOKEN", "layer_flops_per_token", float),
    ("DTCP_ATTENTION_HEADS", "attention_heads", _parse_ints),
    ("DTCP_AUTO_PLACEMENT", "auto_placement", _parse_choice),
    ("DTCP_RING_STEPS_PER_LAUNCH", "ring_steps_per_launch", _parse_steps),
    ("DTCP_KERNEL_REPLAY", "kernel_replay", _parse_bool),
    ("DTCP_ALLGATHER_EXCHANGE", "allgather_exchange", _parse_bool),
)


@dataclasses.dataclass
class Config:
    """dtcp's settings (see the module docstring for the table). Assigning checks the value."""

    timeout_s: float = 30.0
    check_every_call: bool = False
    transport: str = "auto"
    high_priority_ring: bool = True
    merge: str = "auto"
    merge_slots_bytes: int = 512 * 2**20
    allgather_exchange: bool = True
    allgather_max_bytes: int = 16 * 2**20
    eager_fast_path: bool = True
    traced_allgather: bool = True
    one_launch: bool = True
    ring_one_launch: bool = True
    varlen_gaps: bool = True
    kernel_replay: bool = True
    ring_steps_per_launch: Union[int, str] = 1
    ring_groups_in_place: bool = True
    cost_machine: object = None
    cost_objective: str = "auto"
    layer_flops_per_token: Optional[float] = None
    attention_heads: Optional[tuple] = None
    auto_placement: str = "ring"

    def cost_objective_in_force(self) -> str:
        """The objective `strategy="auto"` minimizes: cost_objective, with "auto" resolved ("step"
        where layer_flops_per_token is set, else "call"). Raises where "step" has no layer FLOPs."""
        objective = self.cost_objective
        if objective == "auto":
            return "step" if self.layer_flops_per_token is not None else "call"
        if objective == "step" and self.layer_flops_per_token is None:
            raise ValueError("dtcp.config.cost_objective='step' weighs each call's host time against the rest of its "
                             "layer: set dtcp.config.layer_flops_per_token (6 x the layer's matmul parameters) or "
                             "DTCP_LAYER_FLOPS_PER_TOKEN, or use cost_objective 'auto'")
        return objective

    def layer_work(self, flops: Optional[float], attention_heads: Optional[tuple] = None):
        """A block in which layer_flops_per_token is `flops` and attention_heads is
        `attention_heads` (what the integrations read from the model), each unless it is set
        already (the user's value stands) or not given (None, or 0 FLOPs)."""
        changes = {}
        if flops and self.layer_flops_per_token is None:
            changes["layer_flops_per_token"] = flops
        if attention_heads is not None and self.attention_heads is None:
            changes["attention_heads"] = attention_heads
        return self.override(**changes) if changes else contextlib.nullcontext(self)

    def __setattr__(self, name: str, value) -> None:
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise AttributeError(f"dtcp.config has no setting {name!r}; settings: "
                                 f"{[f.name for f in dataclasses.fields(self)]}")
        object.__setattr__(self, name, _checked(name, value))
        if name in ("cost_objective", "layer_flops_per_token"):
            # (one string of what auto's picks depend on, for the compiled route key: torch.compile
            # traces reading it, and cannot trace formatting a float)
            object.__setattr__(self, "cost_text", f"{getattr(self, 'cost_objective', '')} "
                                                  f"{getattr(self, 'layer_flops_per_token', None)!r}")

    @classmethod
    def from_env(cls) -> "Config":
        """The defaults, with the settings the environment sets (_ENVIRONMENT). A value that does
        not parse or check raises ValueError naming the variable."""
        cfg = cls()
        for variable, name, parse in _ENVIRONMENT:
            raw = os.environ.get(variable)
            if raw is None:
                continue
            try:
                setattr(cfg, name, parse(raw))
            except (ValueError, TypeError) as e:
                raise ValueError(f"environment variable {variable}={raw!r} (dtcp.config.{name}): {e}") from None
        return cfg

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator["Config"]:
        """Within the block the given settings hold; on exit the previous values return."""
        saved = {name: getattr(self, name) for name in changes}
        try:
            for name, value in changes.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


def _checked(name: str, value):
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ValueError(f"dtcp.config.{name} must be one of {_CHOICES[name]}; got {value!r}")
        return value
    if name == "timeout_s":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"dtcp.config.timeout_s must be a positive number of seconds; got {value!r}")
        return float(value)
    if name in ("allgather_max_bytes", "merge_slots_bytes"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"dtcp.config.{name} must be an int >= 0 (bytes); got {value!r}")
        return value
    if name == "ring_steps_per_launch":
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"dtcp.config.ring_steps_per_launch must be an int >= 1 (1: one launch per ring step) "
                             f"or \"auto\" (the cost model chooses per call); got {value!r}")
        return value
    if name == "layer_flops_per_token":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"dtcp.config.layer_flops_per_token must be a positive number of FLOPs per token (6 x "
                             f"a layer's matmul parameters, forward + backward) or None; got {value!r}")
        return None if value is None else float(value)
    if name == "attention_heads":
        if value is None:
            return None
        if not (isinstance(value, (tuple, list)) and len(value) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value)
                and value[0] % value[1] == 0):
            raise ValueError(f"dtcp.config.attention_heads must be (query heads, key/value heads, head dim), three "
                             f"positive ints with the query heads a multiple of the key/value heads (e.g. (32, 8, "
                             f"128)), or None; got {value!r}")
        return tuple(value)
    if name == "cost_machine":
        if value is not None and not hasattr(value, "kernel_flops_per_s"):
            raise TypeError(f"dtcp.config.cost_machine must be a dtcp.plan.Machine (e.g. dtcp.calibrate()) or None; "
                            f"got {type(value).__name__}")
        return value
    if not isinstance(value, bool):
        raise TypeError(f"dtcp.config.{name} must be True or False; got {value!r}")
    return value


config = Config.from_env()
