"""Router policies: an open registry of names (docs/design.md, Open registry), like ``fairway.policies``.

``make_router("fairway", clock=..., cost=..., theta=8)`` builds a registered router policy;
``make_router("my.module:MyRouter", ...)`` or ``make_router("my.module.MyRouter", ...)`` imports
a ``RouterPolicy`` subclass by dotted path (Ray's ``request_router_class`` +
``request_router_kwargs``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fairway.clock import Clock, ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.registry import checked_spec, resolve_class
from fairway.routing.anchors import (
    LLMD,
    AIBrix,
    ConsistentHash,
    Dynamo,
    LLMDBaseline,
    Pow2,
    PrefixHash,
    RayPrefix,
    RoundRobin,
    SessionHash,
    SGLang,
    SGLangClassic,
    VLLMLoadAware,
    VLLMPrefixAware,
)
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, choice, make_states, ranks_of
from fairway.routing.fairway import FairwayRouter

ROUTERS: dict[str, type[RouterPolicy]] = {}


def register_router(cls: type[RouterPolicy]) -> type[RouterPolicy]:
    """Register a router policy class under its ``name`` (usable as a decorator)."""
    ROUTERS[cls.name] = cls
    return cls


for _cls in (RoundRobin, Pow2, ConsistentHash, PrefixHash, SessionHash, RayPrefix, SGLang, SGLangClassic, Dynamo,
             LLMD, LLMDBaseline, AIBrix, VLLMPrefixAware, VLLMLoadAware, FairwayRouter):
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


def validated_router(spec: str, options: dict[str, Any] | None = None, *, block_size: int = 16,
                     profile: str = DEFAULT_PROFILE) -> tuple[str, dict[str, Any]]:
    """``spec`` plus ``options`` as (name, options), checked by building the router policy once
    (``RouterError`` on an unknown name or a bad option); see ``validated_policy``."""
    cost = CostModel.from_profile(profile)
    return checked_spec(spec, options, lambda name, **o: make_router(
        name, clock=ManualClock(), cost=cost, block_size=block_size, rng=np.random.default_rng(0), **o), RouterError)


__all__ = [
    "ROUTERS",
    "Ranking",
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
    "validated_router",
]
