"""The cost model behind `strategy="auto"`: predicted time of one attention call (forward, or
forward + backward) per strategy, from communication bytes and steps, link bandwidth and latency,
kernel time at measured rates, and what overlaps with what. Pure Python over numbers.

Per rank, with B batch rows, Hq/Hkv heads, head dims D (q, k) and Dv (v), L local tokens of N
ranks, e bytes per element, and `pairs` the (query, key) pairs the mask leaves visible:

* kernel time, on the slowest rank = 2 * B * heads * pairs * (D + Dv) flops (x 3.5 with the
  backward) at the rate of the kernel that serves the strategy's schedule (`kernel_rates`: cuDNN
  takes only full and square causal blocks, so a schedule of bands or of L x S blocks runs on
  another kernel), slowed for small launches (rate * r / (r + `kernel_half_rows`), r = query rows
  x heads x batch of one launch: the kernel's grid, which a short block with few heads does not
  fill), plus `launch_s` of device time per launch (twice with the backward: the forward's and
  the backward's). `pairs` is the rank with the most work's (a ring or all-gather over an
  unbalanced layout, e.g. zigzag over a long-tailed document mix, waits for it), and launches are
  those of the rank that launches most: a ring step's tasks as one varlen launch per window where
  the kernel has a one-launch form (plan/fuse.py), else one per task. The host's time per launch
  (`call_overhead_s`, three with the backward: forward, backward and the merge; or the kernel's
  own `launch_host_s`, FA4's ~0.5 ms) hides behind the device's work unless it is the larger;
* **ring**: `rounds` steps, each overlapping one K/V transfer (B * Hkv * K * (D + Dv) * e bytes,
  K the keys of the block its holders use: L, or a window's span; in the backward K/V plus
  float32 dK/dV) with one block's kernels; the slowest rank's pairs set the step (contiguous
  causal is unbalanced, zigzag is not);
* **allgather**: one all-gather of K/V, exposed, then the rank's kernels; in the backward a
  float32 reduce-scatter of dK/dV (the forward's gathered K/V is kept). A varlen call over
  documents moves only the keys other ranks read (`allgather_rows`, plan.KeyExchange), and
  their float32 dK/dV back; nothing at all where every document sits on one rank;
* **ulysses**: all-to-alls of q, k, v (K/V heads replicated up to U when Hkv < U) and of out +
  lse back, exposed; the kernels see the whole sequence for Hq / N heads, perfectly balanced; in
  the backward dout goes out and dq, dk, dv come back (the forward's exchanged tensors are kept);
* **hybrid** (U x R mesh): Ulysses over U, then the ring over R groups of U * L tokens.

Copies that reorder tokens or heads are charged at `memory_bytes_per_s`, and each strategy's host
cost per call (`fixed_s`, measured by dtcp.calibrate on a small call) is added: on 2 H200s the
measured times of short calls were the sum of the two, not the larger (the calls do not hide their
host time behind their device time). With `CallShape.host_hidden` (`dtcp.config.cost_objective =
"device"`: a training step whose other layers keep the GPUs busy while the host runs ahead) no
host time counts, neither per launch nor per call: the model ranks the device's time alone. With
`CallShape.other_flops_per_token` (the "step" objective: dtcp.config.layer_flops_per_token) a call
costs max(its device time, its host time - the device time of the rest of its layer): what it
adds to a training step whose host queues each layer while the device runs the one before. The
constants of a machine are a `Machine`: `MACHINES` has measured defaults; `dtcp.calibrate()`
measures the one it runs on. The model ranks strategies; it is checked against measurements by
benchmarks/bench_strategies.py (docs/strategies.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .mask import Task

HEAD_STRATEGIES = ("ulysses", "hybrid")  # heads are exchanged for tokens first


@dataclass(frozen=True)
class Machine:
    """Constants of the cost model for one kind of machine (per GPU)."""

    name: str
    p2p_bytes_per_s: float  # one ring transfer, per direction
    collective_bytes_per_s: float  # all-gather / reduce-scatter / all-to-all, bytes each rank sends per second
    latency_s: float  # per transfer or collective
    kernel_flops_per_s: float  # attention kernel on long blocks (fwd+bwd average)
    kernel_half_rows: int  # query rows x heads x batch of a call that runs at half that rate
    call_overhead_s: float  # host time per kernel call
    memory_bytes_per_s: float  # device memory, for reordering copies (read + write counted)
    kernel_rates: tuple = ()  # (kernel name, fwd+bwd flops/s on long square causal blocks), where known
    fixed_s: tuple = ()  # (strategy, host seconds per call beyond its kernels and transfers)
    # Device time each kernel launch adds beyond its flops (its grid's ramp-up and tail, the merge
    # after a ring launch), per pass. PROVISIONAL: 15 us is an estimate, not a measurement; the
    # per-rank runs of benchmarks/bench_split.py are to measure it (issue 23).
    launch_s: float = 15e-6
    # Host seconds of one launch's forward + backward, per kernel, where it exceeds
    # `call_overhead_s` by far: FA4's launches go through Python (CuTe DSL argument handling),
    # ~0.5 ms a launch pair (H100, FA4 4.0.0b36, measured by dtcp.calibrate's launch_host_s). A
    # rank whose steps hold little work (short documents, 8K tokens per rank) waits on its host:
    # bench_split --profile measured 3.3 ms of device time in a 12 ms pass (issue 23).
    # With FA4's calls replayed (dtcp/kernels/replay.py) calibrate measures 0.10 ms on an H200
    # host (0.17 through the wrapper; benchmarks/results/replay_h200_2026-11-29b.txt). The
    # default stays 0.5 ms: the model leaves out other per-launch host costs, and at 0.15 ms
    # auto's picks on the one-GPU grid moved away from the measured times (bench_split --replay
    # of split_h200_2026-11-29_grid26_causal: 7 of 9 within 5%, against 8 of 9).
    launch_host_s: tuple = (("fa4", 5e-4),)
    # Host seconds a ring launch's forward + backward spend beyond the kernel's own launch: the
    # step's bookkeeping, the gathers of its rows and keys, the merge and the dK/dV adds (a few
    # dozen small tensor operations). Measured on H100 with FA4 (bench_split, long-tailed document
    # mixes with Balanced at N = 8 and 16, where a rank's ring is host-bound): 1-2 ms a launch pair
    # in all, FA4's own ~0.5 ms of it. The all-gather and Ulysses make one launch each way.
    ring_launch_host_s: float = 7e-4
    # The GPU's compute capability: what kernels a prediction on meta tensors assumes (FA4 needs >= 9.0)
    compute_capability: tuple = (9, 0)
    # Dense bf16 matmul rate at a decoder layer's shapes: the rest of a layer's device time under
    # the "step" objective (CallShape.other_flops_per_token). H100 and H200 share their compute;
    # measured by dtcp.calibrate (exec/calibrate.py matmul_flops_per_s).
    matmul_flops_per_s: float = 650e12

    def rate_of(self, kernel: Optional[str]) -> float:
        return dict(self.kernel_rates).get(kernel, self.kernel_flops_per_s)

    def host_of(self, kernel: Optional[str], backward: bool = True) -> float:
        """Host seconds per launch (its forward, or forward + backward and the merge)."""
        pair = dict(self.launch_host_s).get(kernel)
        if pair is None:
            return self.call_overhead_s * (3 if backward else 1.5)
        return pair if backward else pair * 0.4  # (the forward's share of a launch pair, measured ~0.4)

    def fixed_of(self, strategy: str) -> float:
        return dict(self.fixed_s).get(strategy, 0.0)


# One H200 on NVLink, torch 2.11: ring transfers ~295 GB/s per direction, cuDNN/FA4 ~540-600
# TFLOPs fwd+bwd at long blocks (../shared/FACTS.md figures, re-measured by bench_strategies.py).
_H200_NVLINK = Machine("h200-nvlink", p2p_bytes_per_s=295e9, collective_bytes_per_s=280e9, latency_s=25e-6,
                       kernel_flops_per_s=540e12, kernel_half_rows=12288, call_overhead_s=25e-6,
                       memory_bytes_per_s=3.5e12,
                       kernel_rates=(("fa4", 600e12), ("cudnn", 540e12), ("flash", 320e12), ("flex", 330e12),
                                     ("fa2", 320e12), ("math", 40e12)))
MACHINES: dict[str, Machine] = {
    "h200-nvlink": _H200_NVLINK,
    # The same GPUs across nodes, per GPU: 400 Gb/s InfiniBand (50 GB/s), a few microseconds more
    # per message.
    "h200-infiniband": replace(_H200_NVLINK, name="h200-infiniband", p2p_bytes_per_s=45e9,
                               collective_bytes_per_s=40e9, latency_s=40e-6),
}


@dataclass(frozen=True)
class CallShape:
    """What the model needs of one call: per rank, the slowest rank's figures (the same on every
    rank: every rank computes them for all ranks). dtcp.exec.route.call_shape fills them from
    the plans."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    elem_bytes: int
    world_size: int  # N, all CP ranks
    local_len: int  # L, tokens per rank
    backward: bool = True
    # per strategy, filled by whoever knows the plans: the slowest rank's visible pairs, the
    # number of kernel calls, their typical query length and the ring's rounds
    ring_pairs: float = 0  # the slowest rank's visible pairs (per batch row)
    ring_rounds: int = 0
    ring_kv_len: Optional[float] = None  # keys one ring transfer carries (a window's span; None: the whole block)
    ring_calls: int = 1  # kernel launches per pass of the rank that launches most (fused steps: plan/fuse.py)
    ring_q_block: int = 0  # query rows per launch of the slowest rank
    # bytes the fused ring's float32 accumulators move per query-row element (plan/fuse.py
    # accumulator_traffic, summed over rows; the rank that moves most): 0 where steps run task by task
    ring_acc_bytes: float = 0
    # bytes the ring in groups (exec/grouped.py) copies per pass beyond the accumulators, per batch
    # row of the rank that copies most: each group's K/V packed into one buffer, forward and
    # backward, and its dK/dV shares (0 for the ring step by step)
    ring_copy_bytes: float = 0
    # bytes per element of the dK/dV that go home: float32, or the kernel's gradient dtype where
    # every chain is one hop of one share per key (plan/ring.py Step.one_share)
    ring_dkv_bytes: int = 4
    ring_steps_per_launch: int = 1  # received blocks per launch (exec/grouped.py; 1: step by step)
    # The host runs ahead of the device (dtcp.config.cost_objective = "device": a training step whose
    # other layers keep the GPU busy): host time per launch and per call is hidden, the device's counts
    host_hidden: bool = False
    # The "step" objective (dtcp.config.layer_flops_per_token): the device FLOPs per token that the
    # rest of the call's layer spends (forward + backward: its matmuls), so W = other_flops_per_token
    # x batch x local_len / matmul_flops_per_s of device work surround each call. The call then
    # costs the step max(its device time, its host time - W): the host queues the call while the
    # device runs the layer's other work, and only the host time beyond W shows (`predict`).
    other_flops_per_token: Optional[float] = None
    allgather_pairs: float = 0  # the slowest rank's
    allgather_calls: int = 1
    # K/V rows (tokens of one batch row, all K/V heads) the rank that moves most receives or sends,
    # where the call moves only the keys other ranks read (plan.KeyExchange); None: the whole
    # all-gather, (N - 1) x B x L
    allgather_rows: Optional[float] = None
    total_pairs: float = 0  # over the whole sequence (Ulysses' kernels see it for Hq / N heads)
    ulysses_calls: int = 1  # kernel calls after the head exchange (one per document without a varlen kernel)
    ulysses_degree: int = 0  # U of a hybrid mesh (0: 1-D group)
    hybrid_pairs: int = 0  # the slowest head group's visible pairs over its U * L tokens
    hybrid_rounds: int = 0
    hybrid_calls: int = 1
    hybrid_kv_len: Optional[float] = None  # keys one transfer across groups carries (None: the group's whole block)
    # the kernel each strategy's schedule runs on (its rate: Machine.kernel_rates); None: the default
    kernels: tuple = ()  # (strategy, kernel name)

    def kernel_of(self, strategy: str) -> Optional[str]:
        return dict(self.kernels).get(strategy)


@dataclass(frozen=True)
class Prediction:
    strategy: str
    total_s: float
    kernel_s: float
    comm_s: float  # all communication time
    exposed_comm_s: float  # the part no kernel hides
    note: str = ""
    kernel: Optional[str] = None  # the kernel the strategy's schedule runs on (None: the machine's default rate)
    launches: int = 0  # kernel launches per pass on the rank that launches most
    # under the "step" objective (CallShape.other_flops_per_token): the host's time to queue the
    # call and the device time of the rest of its layer (total_s = max(device, host_s - other_s))
    host_s: Optional[float] = None
    other_s: Optional[float] = None


def decoder_layer_flops_per_token(hidden: int, ffn: int, q_heads: int, kv_heads: int, head_dim: int, *,
                                  gated: bool = True, experts_per_token: int = 1, shared_ffn: int = 0) -> float:
    """6 x the matmul parameters one token passes through in a decoder layer (2 FLOPs each forward,
    4 backward): the Q, K, V and output projections, and the MLP of each expert it is routed to
    (`experts_per_token` MLPs of `ffn`, plus `shared_ffn` of shared experts; gated: 3 hidden x ffn
    matrices, else 2). What dtcp.config.layer_flops_per_token wants; the integrations take it
    from the model's config."""
    attention = hidden * (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim * hidden
    mlp = (3 if gated else 2) * hidden * (ffn * experts_per_token + shared_ffn)
    return 6.0 * (attention + mlp)


def task_pairs(task: Task) -> int:
    """Visible (query, key) pairs of one task: 0 <= i < q_len, 0 <= j < k_len, lo <= j - i <= hi.
    Exact, O(1): pairs with j - i <= hi, minus those with j - i <= lo - 1."""
    q, k = task.q_len, task.k_len
    hi = k - 1 if task.hi is None else task.hi
    lo = -(q - 1) if task.lo is None else task.lo
    return max(0, _pairs_up_to(q, k, hi) - _pairs_up_to(q, k, lo - 1))


def _pairs_up_to(q: int, k: int, t: int) -> int:
    # sum over rows i < q of #{j < k : j <= i + t} = sum of clamp(x, 0, k) for x = t+1 .. t+q
    return _clamp_sum(t + 1 + q, k) - _clamp_sum(t + 1, k)


def _clamp_sum(m: int, k: int) -> int:
    """sum of clamp(x, 0, k) over all integers x < m."""
    if m <= 0:
        return 0
    if m <= k:
        return m * (m - 1) // 2
    return k * (k - 1) // 2 + (m - k) * k


def plan_pairs(tasks) -> int:
    """Visible pairs of a list of tasks."""
    return sum(task_pairs(t) for t in tasks)


def _kernel_s(machine: Machine, flops: float, rows: float, calls: int, kernel: Optional[str] = None,
              backward: bool = True, extra_host_s: float = 0.0, host_hidden: bool = False) -> float:
    """Kernel time of `flops` in calls of `rows` query rows x heads x batch each; `extra_host_s`:
    host seconds per call (forward + backward) beyond the kernel's launch (a ring step's);
    `host_hidden`: the device's time alone (CallShape.host_hidden)."""
    peak = machine.rate_of(kernel)
    rate = peak * rows / (rows + machine.kernel_half_rows) if rows > 0 else 1.0
    device = flops / rate + calls * machine.launch_s * (2 if backward else 1)
    if host_hidden:
        return device
    # Launches are asynchronous: the host's cost per call hides behind the GPU's work unless it
    # is the larger (many small calls: documents, short sequences; FA4's Python launches).
    return max(device, calls * _launch_host_s(machine, kernel, backward, extra_host_s))


def _launch_host_s(machine: Machine, kernel: Optional[str], backward: bool, extra_host_s: float = 0.0) -> float:
    """Host seconds of one launch: the kernel's own (Machine.host_of) and `extra_host_s` of
    bookkeeping per forward + backward (a ring step's), the forward's share of it alone."""
    return machine.host_of(kernel, backward) + extra_host_s * (1.0 if backward else 0.4)


def _flops(shape: CallShape, heads: float, pairs: float) -> float:
    mult = 3.5 if shape.backward else 1.0
    return 2.0 * shape.batch * heads * pairs * (shape.head_dim + shape.v_head_dim) * mult


def _ring(machine: Machine, shape: CallShape, kv_heads: int, kv_len: float, heads: float, pairs: int, rounds: int,
          calls: int, q_block: int, kernel_name: Optional[str] = None,
          acc_bytes: float = 0, copy_bytes: float = 0) -> tuple[float, float, float]:
    """(total, kernel, comm, exposed) of a ring over `rounds` steps, each moving `kv_len` keys;
    `acc_bytes`: its fused steps' accumulator traffic (CallShape.ring_acc_bytes); `copy_bytes`:
    its groups' copies (CallShape.ring_copy_bytes)."""
    kernel = _kernel_s(machine, _flops(shape, heads, pairs), q_block * heads * shape.batch, calls, kernel_name,
                       shape.backward, machine.ring_launch_host_s, shape.host_hidden)
    # Fused steps merge into float32 accumulators over the rank's rows: device memory traffic on
    # the kernels' stream (out/lse in the forward over Dv, dQ in the backward over D). On 2 H100s
    # with FA4, without this term the model put the ring 1.4-1.7 ms under its measured time at 32K
    # tokens of packed documents (bench_strategies.py, 2026-11-26) and picked it over a faster all-gather.
    elems = shape.batch * heads * (shape.v_head_dim + (shape.head_dim if shape.backward else 0))
    kernel += elems * acc_bytes / machine.memory_bytes_per_s
    kernel += shape.batch * copy_bytes * (1.0 if shape.backward else 0.25) / machine.memory_bytes_per_s
    kv = shape.batch * kv_heads * kv_len * (shape.head_dim + shape.v_head_dim)
    per_step = kernel / (rounds + 1)
    t_fwd = machine.latency_s + kv * shape.elem_bytes / machine.p2p_bytes_per_s
    if not shape.backward:
        total = per_step + rounds * max(per_step, t_fwd)
        return total, kernel, rounds * t_fwd, total - kernel
    fwd_share = 1.0 / 3.5
    c_f, c_b = per_step * fwd_share, per_step * (1 - fwd_share)
    # Backward: round i brings a K/V block (as in the forward) while the float32 dK/dV of the
    # block before travel back to their owner; the last block's dK/dV return after the last step.
    t_dkv = machine.latency_s + kv * shape.ring_dkv_bytes / machine.p2p_bytes_per_s
    total = c_f + rounds * max(c_f, t_fwd) + c_b
    if rounds:
        total += max(c_b, t_fwd) + (rounds - 1) * max(c_b, t_fwd + t_dkv) + t_dkv
    comm = 2 * rounds * t_fwd + rounds * t_dkv
    return total, kernel, comm, total - kernel


def predict(strategy: str, shape: CallShape, machine: Machine, outer: Optional[Machine] = None) -> Prediction:
    """Predicted time of one call of `shape` under `strategy` on `machine`. `outer`: the links
    across the Ulysses groups of a hybrid mesh when they differ (e.g. InfiniBand between nodes,
    NVLink inside them); the kernel figures are always `machine`'s."""
    if shape.other_flops_per_token is not None:
        return _in_step(strategy, shape, machine, outer)
    n, b, e = shape.world_size, shape.batch, shape.elem_bytes
    d, dv = shape.head_dim, shape.v_head_dim
    if strategy == "ring":
        kv_len = shape.local_len if shape.ring_kv_len is None else shape.ring_kv_len
        total, kernel, comm, exposed = _ring(machine, shape, shape.kv_heads, kv_len, shape.q_heads,
                                             shape.ring_pairs, shape.ring_rounds, shape.ring_calls,
                                             shape.ring_q_block or shape.local_len, shape.kernel_of("ring"),
                                             shape.ring_acc_bytes, shape.ring_copy_bytes)
        g = shape.ring_steps_per_launch
        note = f"{g} received blocks a launch (dtcp.config.ring_steps_per_launch)" if g > 1 else ""
        return Prediction("ring", total + _fixed(machine, "ring", shape), kernel, comm, exposed, note,
                          kernel=shape.kernel_of("ring"), launches=shape.ring_calls)
    if strategy == "allgather":
        kernel = _kernel_s(machine, _flops(shape, shape.q_heads, shape.allgather_pairs),
                           shape.local_len * shape.q_heads * b, shape.allgather_calls, shape.kernel_of("allgather"),
                           shape.backward, host_hidden=shape.host_hidden)
        row = shape.kv_heads * (d + dv)  # elements of one token's K and V
        own = b * shape.local_len
        moved = (n - 1) * own if shape.allgather_rows is None else shape.allgather_rows
        latency = machine.latency_s if moved else 0.0  # (no collective where no rank moves a row)
        comm = latency + moved * row * e / machine.collective_bytes_per_s
        copies = 2 * (own + moved) * row * e / machine.memory_bytes_per_s  # the K/V put in the launch's order (one copy)
        if shape.backward:
            comm += latency + moved * row * 4 / machine.collective_bytes_per_s
            copies += 2 * (own + moved) * row * 4 / machine.memory_bytes_per_s  # float32 dK/dV summed per key
        fixed = _fixed(machine, "allgather", shape)
        return Prediction("allgather", kernel + comm + copies + fixed, kernel, comm, comm + copies,
                          kernel=shape.kernel_of("allgather"), launches=shape.allgather_calls)
    if strategy in HEAD_STRATEGIES:
        u = n if strategy == "ulysses" else shape.ulysses_degree
        if u < 1 or n % u:
            raise ValueError(f"{strategy}: ulysses degree {u} does not divide {n} ranks")
        kv_heads_sent = max(shape.kv_heads, u)  # replicated up to U when Hkv < U
        share = (u - 1) / u
        l_len = shape.local_len
        fwd_send = b * l_len * (shape.q_heads * d + kv_heads_sent * (d + dv)) * e
        fwd_back = b * l_len * shape.q_heads * (dv * e + 4)  # out and float32 lse
        bytes_moved = fwd_send + fwd_back
        if shape.backward:
            grad_kv_bytes = 4 if kv_heads_sent > shape.kv_heads else e
            bytes_moved += b * l_len * shape.q_heads * dv * e  # dout out
            bytes_moved += b * l_len * (shape.q_heads * d * e + kv_heads_sent * (d + dv) * grad_kv_bytes)
        rounds = 4 if shape.backward else 2
        comm = rounds * machine.latency_s + share * bytes_moved / machine.collective_bytes_per_s
        # each byte is copied twice (packed into the send buffer, unpacked into place), and a copy
        # of X bytes reads and writes: 2X at memory_bytes_per_s (which counts both)
        copies = 4 * bytes_moved / machine.memory_bytes_per_s
        if strategy == "ulysses":
            kernel = _kernel_s(machine, _flops(shape, shape.q_heads / u, shape.total_pairs),
                               n * l_len * shape.q_heads / u * b / shape.ulysses_calls, shape.ulysses_calls,
                               shape.kernel_of("ulysses"), shape.backward, host_hidden=shape.host_hidden)
            fixed = _fixed(machine, "ulysses", shape)
            return Prediction("ulysses", kernel + comm + copies + fixed, kernel, comm, comm + copies,
                              kernel=shape.kernel_of("ulysses"), launches=shape.ulysses_calls)
        r = n // u
        # the links of `outer`, everything else (kernels, host, memory) of `machine`
        across = machine if outer is None else replace(machine, p2p_bytes_per_s=outer.p2p_bytes_per_s,
                                                       collective_bytes_per_s=outer.collective_bytes_per_s,
                                                       latency_s=outer.latency_s)
        kv_len = u * l_len if shape.hybrid_kv_len is None else shape.hybrid_kv_len
        ring_total, kernel, ring_comm, ring_exposed = _ring(
            across, shape, max(1, kv_heads_sent // u), kv_len, shape.q_heads / u, shape.hybrid_pairs,
            shape.hybrid_rounds, shape.hybrid_calls, u * l_len, shape.kernel_of("hybrid"))  # (accumulators not counted)
        note = f"ulysses {u} x ring {r}"
        fixed = _fixed(machine, "hybrid", shape)
        return Prediction("hybrid", ring_total + comm + copies + fixed, kernel, comm + ring_comm,
                          comm + copies + ring_exposed, note, kernel=shape.kernel_of("hybrid"),
                          launches=shape.hybrid_calls)
    raise ValueError(f"predict: unknown strategy {strategy!r}")


def _in_step(strategy: str, shape: CallShape, machine: Machine, outer: Optional[Machine]) -> Prediction:
    """The call's cost inside a training step (CallShape.other_flops_per_token): per layer the
    device runs the call and W seconds of other work while the host queues both, so the layer
    takes max(device + W, host) and the call costs max(device, host - W) of it. At W = 0 the larger
    of the two; for W beyond the host's time, the device's alone (the "device" objective)."""
    device = predict(strategy, replace(shape, host_hidden=True, other_flops_per_token=None), machine, outer)
    other = shape.other_flops_per_token * shape.batch * shape.local_len * (1.0 if shape.backward else 1 / 3)
    w = other / machine.matmul_flops_per_s
    host = host_s(strategy, shape, machine)
    total = max(device.total_s, host - w)
    note = (f"in a step: device {device.total_s * 1e3:.2f} ms, host {host * 1e3:.2f} ms, "
            f"layer's other work {w * 1e3:.2f} ms")
    return replace(device, total_s=total, note="; ".join(x for x in (device.note, note) if x), host_s=host, other_s=w)


def hidden_ring_steps(objective: str, layer_flops_per_token: Optional[float], batch: int, local_len: int,
                      world_size: int, machine: Machine, kernel: str = "fa4") -> int:
    """How many of a rank's ring steps queue on the host while the device runs the rest of their
    layer (`Balanced(hidden_steps=)`: those steps' host time costs the placement nothing), under
    `objective` (dtcp.config.cost_objective_in_force()): "call" none; "device" all of them
    (`world_size`: a rank has at most that many); "step" as many as the layer's other device work
    per pass (W = layer_flops_per_token x batch x local_len / matmul_flops_per_s, as `_in_step`
    weighs a call) covers at one ring step's host time each (a forward and backward launch of
    `kernel` and the step's bookkeeping: Machine.launch_host_s, ring_launch_host_s), at most
    `world_size`."""
    if objective == "call":
        return 0
    if objective == "device":
        return world_size
    if objective != "step" or not layer_flops_per_token:
        raise ValueError(f"hidden_ring_steps: objective {objective!r} needs 'call', 'device', or 'step' with "
                         "layer_flops_per_token")
    other_s = layer_flops_per_token * batch * local_len / machine.matmul_flops_per_s
    step_s = _launch_host_s(machine, kernel, True, machine.ring_launch_host_s)
    return min(world_size, int(other_s / step_s))


def host_s(strategy: str, shape: CallShape, machine: Machine) -> float:
    """The host's time to queue one call: its launches (the kernel's own host time per launch, a
    ring step's bookkeeping on the ring's) and the strategy's fixed cost per call (Machine.fixed_s)."""
    calls = {"ring": shape.ring_calls, "allgather": shape.allgather_calls, "ulysses": shape.ulysses_calls,
             "hybrid": shape.hybrid_calls}[strategy]
    step = machine.ring_launch_host_s if strategy in ("ring", "hybrid") else 0.0  # (as _ring charges its launches)
    return calls * _launch_host_s(machine, shape.kernel_of(strategy), shape.backward, step) + machine.fixed_of(strategy)


def _fixed(machine: Machine, strategy: str, shape: CallShape) -> float:
    """A call's host seconds beyond its kernels and transfers (Machine.fixed_s); none when the
    host runs ahead (CallShape.host_hidden)."""
    return 0.0 if shape.host_hidden else machine.fixed_of(strategy)


def rank(strategies, shape: CallShape, machine: Machine) -> list[Prediction]:
    """Predictions for `strategies`, fastest first (ties keep the given order)."""
    preds = [predict(s, shape, machine) for s in strategies]
    return sorted(preds, key=lambda p: p.total_s)


def machine_for(override: Optional[Machine]) -> Machine:
    """The constants in force: `dtcp.config.cost_machine` (set by dtcp.calibrate() or by hand),
    else the shipped H200 NVLink figures."""
    return override if override is not None else MACHINES["h200-nvlink"]
