"""Agreement and failure across the ranks of a group: nobody hangs, nobody is silently wrong.

Every rank of a group must make the same dtcp calls with its own shards. What one rank cannot
check by itself is settled here, through the group's store (host-side, a bounded wait, no GPU
synchronisation):

* **Agreement.** The first time a rank builds a route for a call signature (and on every call with
  `dtcp.config.check_every_call`), all ranks post a description of their call (shapes, dtypes,
  layout, mask, window, scale, `cu_seqlens` digest, ...) and its local status (ok, or the error
  it raised), then read everyone's. Different arguments raise `PeerMismatchError` on every rank,
  naming the fields and ranks; a rank's own error raises `PeerFailedError` on the others. One
  round per new route; none per step in steady state.
* **Failure.** A rank that fails inside a dtcp call after communication may have started posts an
  abort record, aborts dtcp's own communicator and marks the group failed: every later dtcp call
  on the group raises `GroupFailedError` at once. Ranks waiting in an agreement see the record
  within milliseconds; ranks waiting for data see their transport's bounded wait expire
  (`dtcp.config.timeout_s`, dtcp's communicator is made with that timeout) or, on the copy
  engines, the watchdog release their GPU (dtcp/comm/copy_engine.py).

Keys live under a namespace per group *instance* (group name + generation), so a group destroyed
and created again with the same name starts clean; each rank deletes its own keys once no rank
can still read them.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import _compat
from ..config import config
from ..errors import GroupFailedError, PeerFailedError, PeerMismatchError, PeerTimeoutError

_POLL_S = 0.05


class GroupGuard:
    """Agreement rounds and the failed state of one process group (one per group object)."""

    def __init__(self, pg: "dist.ProcessGroup"):
        self.name = _compat.name_of_group(pg)
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
        base = _compat.store_of_group(pg)
        # Members of the k-th instance of a group name all draw from [k*N + 1, (k+1)*N]: a rank
        # reaches instance k+1 only after an agreement of instance k, which needs every member's draw.
        self.generation = (base.add(f"dtcp/{self.name}/members", 1) - 1) // self.size
        self.store = dist.PrefixStore(f"dtcp/{self.name}/{self.generation}/", base)
        self.round = 0
        self.completed_round = -1
        self.failure: Optional[str] = None
        self._on_fail: list = []  # callables run once when the group fails (abort the communicator, ...)

    # ---- failed state ----------------------------------------------------------------------------
    def check_healthy(self) -> None:
        if self.failure is not None:
            raise GroupFailedError(
                f"dtcp: an earlier call on process group {self.name!r} failed, so its dtcp state is unusable: "
                f"{self.failure}. Create a new process group (or restart the job) to go on."
            )

    def on_fail(self, fn) -> None:
        self._on_fail.append(fn)

    def fail(self, message: str) -> None:
        """Mark the group failed on this rank and tell the others (first message wins)."""
        if self.failure is not None:
            return
        self.failure = message
        try:
            self.store.compare_set("abort", "", message)
        except Exception:  # noqa: BLE001 - the store may be gone with a dead peer; the mark stays local
            pass
        for fn in self._on_fail:
            fn()

    def peer_failure(self) -> Optional[str]:
        """Another rank's abort record, if any (one store lookup)."""
        try:
            if self.store.check(["abort"]):
                return self.store.get("abort").decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None
        return None

    # ---- agreement -------------------------------------------------------------------------------
    def agree(self, what: str, fields: dict[str, str], status: Optional[str] = None) -> None:
        """One agreement round (see the module docstring). `fields` describe this rank's call;
        `status` is None, or the error this rank raises (then this rank does not wait: it posts
        and returns, and the caller raises its own error). Raises on the others' problems."""
        posts = self.exchange_posts(what, {"fields": fields, "status": status}, wait=status is None)
        if posts is None:
            return
        errors = [(r, p["status"]) for r, p in enumerate(posts) if p["status"] is not None]
        if errors:
            r, status = errors[0]
            raise PeerFailedError(f"{what}: rank {r} of process group {self.name!r} raised: {status}")
        diffs = _differences([p["fields"] for p in posts])
        if diffs:
            raise PeerMismatchError(
                f"{what}: the ranks of process group {self.name!r} called dtcp with different arguments: "
                + "; ".join(diffs)
                + ". Every rank must make the same call, each with its own shard of the same sequence."
            )

    def exchange_posts(self, what: str, payload: dict, wait: bool = True) -> Optional[list[dict]]:
        """Post `payload` (JSON-able) for this round and, with `wait`, return every rank's, in rank
        order. Bounded by dtcp.config.timeout_s; another rank's abort record ends the wait."""
        self.check_healthy()
        rnd = self.round
        self.round += 1
        key = f"agree/{rnd}/"
        self.store.set(key + str(self.rank), json.dumps(payload))
        if not wait:
            return None
        keys = [key + str(r) for r in range(self.size)]
        self._wait_for(keys, what, rnd)
        posts = [json.loads(v) for v in self.store.multi_get(keys)]
        if self.completed_round == rnd - 1 and rnd >= 2:
            self.store.delete_key(f"agree/{rnd - 2}/{self.rank}")  # every rank has read round rnd - 2
        self.completed_round = rnd
        return posts

    def _wait_for(self, keys: list[str], what: str, rnd: int) -> None:
        # Polls with `check` (one round trip, never blocks), backing off from 1 ms to 50 ms: a
        # blocking store wait cannot be interrupted by another rank's abort record, and short
        # blocking waits make the store log a warning each time they expire.
        deadline = time.monotonic() + config.timeout_s
        pause = 0.001
        while not self.store.check(keys):
            peer = self.peer_failure()
            if peer is not None:
                self.fail(f"another rank failed: {peer}")
                raise PeerFailedError(f"{what}: {peer}")
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if not self.store.check([keys[r]])]
                message = (f"rank {self.rank} waited {config.timeout_s:g} s (dtcp.config.timeout_s) for ranks "
                           f"{missing} of process group {self.name!r} to reach the same dtcp call ({what}, "
                           f"agreement round {rnd}); they are making other calls, or failed before this one")
                self.fail(message)
                raise PeerTimeoutError(f"{what}: {message}")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)


def _differences(all_fields: list[dict[str, str]]) -> list[str]:
    """For each field on which ranks disagree: 'name: rank 0 <value>, rank 1 <value>, ...'."""
    out = []
    names = list(dict.fromkeys(n for f in all_fields for n in f))
    for name in names:
        values = [f.get(name, "<missing>") for f in all_fields]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            out.append(f"{name}: " + ", ".join(f"rank{'s' if len(rs) > 1 else ''} "
                                                 f"{','.join(map(str, rs))} {v}" for v, rs in groups.items()))
    return out


def digest(values) -> str:
    """A short, stable digest of a sequence of ints (e.g. cu_seqlens values) for agreement fields."""
    if values is None:
        return "None"
    h = hashlib.sha1(",".join(map(str, values)).encode()).hexdigest()[:12]
    return f"{len(values)} values, sha1 {h}"


def tensor_digest(values: torch.Tensor) -> str:
    """`digest` for an integer tensor of any shape, dtype or device (a batch's token ids): the
    SHA-1 of its values as little-endian int64, in row-major order, so ranks holding the same
    values agree whatever their integer dtype. The HF block digests a batch's ids every step: 128K
    ids joined as text took 28 ms of host time on a 2-core CPU, their bytes hash in 1-1.5 ms
    (benchmarks/bench_new_batch.py; numpy gives the bytes, and without numpy the text form serves)."""
    flat = values.detach().reshape(-1).to("cpu", torch.int64)
    try:
        import numpy  # noqa: F401  (torch's .numpy() needs it; transformers installs it)
    except ImportError:
        return digest(flat.tolist())
    raw = flat.contiguous().numpy().astype("<i8", copy=False).tobytes()
    return f"{flat.numel()} values, sha1 {hashlib.sha1(raw).hexdigest()[:12]} (int64 bytes)"
