"""The errors dtcp raises when ranks of a group disagree or one of them fails.

Bad arguments raise `ValueError`/`TypeError` naming the parameter. What one rank cannot see by
itself (another rank's arguments, another rank's failure, a rank that stopped answering) raises
one of these on every rank of the group.
"""

from __future__ import annotations


class DtcpError(RuntimeError):
    """Base class of dtcp's group-level errors."""


class PeerMismatchError(DtcpError, ValueError):
    """The ranks of a group called dtcp with different arguments (shapes, layout, mask, ...)."""


class PeerFailedError(DtcpError):
    """Another rank of the group failed inside dtcp (its message is included)."""


class PeerTimeoutError(DtcpError, TimeoutError):
    """A rank waited longer than `dtcp.config.timeout_s` for another rank of the group."""


class GroupFailedError(DtcpError):
    """An earlier dtcp call on this group failed: the group's dtcp state is unusable. Every later
    call raises this at once; create a new process group (or restart) to go on."""
