"""Router policies: an open registry of names (STYLE.md #1), like ``router.policies``.

``make_router("fairway", clock=..., cost=..., theta=8)`` builds a registered router policy;
``make_router("my.module:MyRouter", ...)`` or ``make_router("my.module.MyRouter", ...)`` imports
a ``RouterPolicy`` subclass by dotted path (Ray's ``request_router_class`` +
``request_router_kwargs``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from router.clock import Clock
from router.cost_model import CostModel
from router.registry import resolve_class
from router.routing.anchors import (
    LLMD,
    AIBrix,
    ConsistentHash,
    Dynamo,
    Pow2,
    RayPrefix,
    RoundRobin,
    SGLang,
    VLLMPrefixAware,
)
from router.routing.base import ReplicaState, RouteRequest, RouterPolicy, choice, make_states, ranks_of
from router.routing.fairway import FairwayRouter

ROUTERS: dict[str, type[RouterPolicy]] = {}


def register_router(cls: type[RouterPolicy]) -> type[RouterPolicy]:
    """Register a router policy class under its ``name`` (usable as a decorator)."""
    ROUTERS[cls.name] = cls
    return cls


for _cls in (RoundRobin, Pow2, ConsistentHash, RayPrefix, SGLang, Dynamo, LLMD, AIBrix, VLLMPrefixAware,
             FairwayRouter):
    register_router(_cls)


class RouterError(ValueError):
    """An unknown router name or bad router options."""


def router_class(name: str) -> type[RouterPolicy]:
    """The class registered as ``name``, or imported from ``module:Class`` / ``module.Class``."""
    return resolve_class(name, ROUTERS, RouterPolicy, "router", RouterError)


def make_router(
    name: str,
    *,
    clock: Clock,
    cost: CostModel,
    block_size: int = 16,
    rng: np.random.Generator | None = None,
    **kwargs: Any,
) -> RouterPolicy:
    """Build the router policy ``name`` with its options (``kwargs``); bad options raise
    ``RouterError`` naming the router."""
    cls = router_class(name)
    try:
        return cls(clock, cost, block_size, rng, **kwargs)
    except (TypeError, ValueError) as e:
        raise RouterError(f"bad options for router {name!r}: {e}") from e


__all__ = [
    "ROUTERS",
    "ReplicaState",
    "RouteRequest",
    "RouterError",
    "RouterPolicy",
    "choice",
    "make_router",
    "make_states",
    "ranks_of",
    "register_router",
    "router_class",
]
