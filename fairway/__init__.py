"""The pure core of Fairway: every decision the product makes, with no I/O and no host imports.

Clock and registries, block hashing, the cost model, the request and wire types, the queue
policies (``fairway.policies``), the router policies and the routing host (``fairway.routing``),
the prefix index, the load view and the engine model (``fairway.engine``). Every object takes an
injected clock (and RNG where it draws), so the simulator, the replica gate and the Ray Serve
request router run this very code. This package imports nothing else from the repository; the
import-linter contracts in ``pyproject.toml`` keep it so.
"""
