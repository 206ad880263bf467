"""Multi-process test harness: a pool of spawned ranks (gloo on CPU, or NCCL with one GPU per rank)
that runs test functions.

    pool = RankPool(world_size=4)
    results = pool.run(my_check, arg1, arg2, timeout=120)   # list of per-rank return values

`my_check(*args)` runs on every rank at once, inside an initialised default process group, and
must be importable (a module-level function of a test module). A rank that raises makes `run`
raise with that rank's traceback; a rank that does not answer within `timeout` seconds makes
`run` kill the pool and raise, so a broken collective never hangs the suite. Pools are reused
between tests (spawning ranks and importing torch is the slow part) and rebuilt after a failure.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, pg_backend: str = "gloo") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared machines
    torch.set_num_threads(1)
    try:
        if pg_backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(pg_backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, start_timeout: float = 180.0, pg_backend: str = "gloo"):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results, pg_backend), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(start_timeout, "start")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", str(fn)))

    def _collect(self, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        values, failures = {}, {}
        while len(values) + len(failures) < self.world_size:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(values) - set(failures))
                dead = [r for r in missing if not self._procs[r].is_alive()]
                if dead:  # a rank whose process ended without answering: report it at once
                    for r in dead:
                        failures[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                    continue
                if time.monotonic() < deadline:
                    continue
                self.close()
                msg = f"{what}: ranks {missing} did not answer within {timeout:.0f}s (pool killed)"
                if failures:
                    msg += "\n" + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
                raise TimeoutError(msg)
            (values if ok else failures)[rank] = value
        if failures:
            raise AssertionError(
                f"{what} failed on ranks {sorted(failures)}:\n"
                + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, pg_backend: str = "gloo") -> RankPool:
    """A live pool of `world_size` ranks on `pg_backend` ("gloo" on CPU, "nccl" one GPU each),
    shared across tests."""
    pool = _POOLS.get((world_size, pg_backend))
    if pool is None or not pool.alive:
        pool = RankPool(world_size, pg_backend=pg_backend)
        _POOLS[(world_size, pg_backend)] = pool
    return pool


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0, pg_backend: str = "gloo", **kwargs) -> list:
    """Run fn on `world_size` ranks (fn's keyword arguments pass through; `pg_backend` is the
    process group's); rebuild the pool if a previous failure left it broken."""
    pool = get_pool(world_size, pg_backend)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except AssertionError:
        # A rank raised: the other ranks may be stuck in a collective with it. Start afresh.
        pool.close()
        _POOLS.pop((world_size, pg_backend), None)
        raise
    except TimeoutError:
        _POOLS.pop((world_size, pg_backend), None)
        raise


def run_in_fresh_pool(world_size: int, fn, *args, timeout: float = 120.0, pg_backend: str = "gloo", **kwargs) -> list:
    """Run fn on a pool of its own, closed afterwards (for tests that tear down the default group,
    or that leave a CUDA context unusable on purpose)."""
    pool = RankPool(world_size, pg_backend=pg_backend)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()


_HYBRID: dict = {}


def _hybrid_groups(as_mesh: bool = True):
    """On a 4-rank pool: a 2x2 CP mesh (dim 0 "ring", dim 1 "ulysses"; CP rank = ring rank * 2 +
    Ulysses rank), as a DeviceMesh or as the (ring group, Ulysses group) pair. Made once per pool
    (creating groups is collective: every rank makes them in the same order)."""
    if "mesh" not in _HYBRID:
        from torch.distributed.device_mesh import init_device_mesh

        _HYBRID["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    mesh = _HYBRID["mesh"]
    return mesh if as_mesh else (mesh.get_group(0), mesh.get_group(1))


def close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
