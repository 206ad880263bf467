"""dtcp's watchdog: one daemon thread that turns another rank's failure, or a GPU wait that never
ends, into an error on this rank while its GPU is blocked.

On CUDA, dtcp's waits for peers happen on the GPU (copy-engine flag waits, NCCL kernels), where no
Python runs. Every 0.1 s the watchdog looks, for each group used on CUDA, for another rank's abort
record (one store lookup) and, for each copy-engine ring, for a wait older than
`dtcp.config.timeout_s`. Either fails the group (dtcp/comm/groups.py): its health word is cleared,
copy-engine waits are released and dtcp's NCCL communicator is aborted, so the blocked stream goes
on and stops at the health assertion that every dtcp call on CUDA enqueues at its end. Groups on CPU
(gloo) need no watchdog: their waits are on the host and bounded by dtcp's communicator timeout.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Optional


log = logging.getLogger("dtcp")

_PERIOD_S = 0.1
_watched: "weakref.WeakSet" = weakref.WeakSet()
_thread: Optional[threading.Thread] = None
_lock = threading.Lock()
_stop = threading.Event()


def watch(state) -> None:
    """Watch `state` (a GroupState used on CUDA) from now on."""
    global _thread
    with _lock:
        _watched.add(state)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="dtcp-watchdog", daemon=True)
            _thread.start()


def check(state) -> None:
    """One pass over one group (the thread's body; tests call it directly)."""
    if state.guard.failure is not None or not state.registered():
        _watched.discard(state)  # failed already, or destroyed: nothing left to watch
        return
    for ring in list(state.copy_engines.values()):
        stalled = ring.stalled() if ring is not None else None
        if stalled is not None:
            log.error("dtcp: %s; failing the group", stalled)
            state.guard.fail(stalled)
            return
    peer = state.guard.peer_failure()
    if peer is not None:
        log.error("dtcp: another rank of process group %r failed (%s); failing the group on rank %d",
                  state.name, peer, state.rank)
        state.guard.fail(f"another rank failed: {peer}")


def _run() -> None:
    while not _stop.wait(_PERIOD_S):
        for state in list(_watched):
            try:
                check(state)
            except Exception:  # noqa: BLE001 - the watchdog must not die; the next pass retries
                log.exception("dtcp: watchdog pass failed")


@atexit.register
def stop_at_exit() -> None:
    """Stop the thread before the interpreter tears down CUDA and the stores it reads (a daemon
    thread caught inside a CUDA or store call at exit takes the process down with it). Also run
    by dtcp/comm/groups.py's exit release, before it lets go of the groups the thread watches."""
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=1.0)
