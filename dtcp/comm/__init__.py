"""Communication: per-group state and agreement (groups, guard), the ring's point-to-point
exchange (p2p, copy_engine), the all-gather schedule's collectives, and the byte counters."""

from .groups import GroupState, on_device_of, state_of
from .stats import STATS, CommStats

__all__ = ["GroupState", "state_of", "on_device_of", "STATS", "CommStats"]
