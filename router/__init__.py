"""Fairway router: block hashing, cost model and queue policies shared by every host.

The objects in this package are pure: they take an injected clock and never do I/O,
so the simulator (`sim/`), the replica gate (`replicas/`) and the Ray Serve router run
the very same code.
"""
