"""Ways to reach dtcp's attention besides the functions in dtcp/api.py: the SDPA-rewriting context
manager (context.py), the scoped sliding window (window.py) and DTensor support (dtensor.py)."""
