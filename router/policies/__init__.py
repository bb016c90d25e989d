"""Queue policies: an open registry of names (STYLE.md #1).

``make_policy("fairway", clock=..., cost=..., theta=6)`` builds a registered policy;
``make_policy("my.module:MyPolicy", ...)`` imports a class by dotted path.
"""

from __future__ import annotations

from typing import Any

from router.clock import Clock
from router.cost_model import CostModel
from router.policies.base import FAIR, FAST, Admission, QueuedRequest, QueuePolicy
from router.policies.baselines import (
    FCFS,
    HRRN,
    KLPM,
    LPM,
    VLLMSJF,
    DFSWeight,
    LPMAging,
    SRPTOracle,
)
from router.policies.fairway import Fairway, FairwayConfig
from router.registry import resolve_class

POLICIES: dict[str, type[QueuePolicy]] = {}


def register_policy(cls: type[QueuePolicy]) -> type[QueuePolicy]:
    """Register a policy class under its ``name`` (usable as a decorator)."""
    POLICIES[cls.name] = cls
    return cls


for _cls in (FCFS, LPM, DFSWeight, HRRN, KLPM, LPMAging, VLLMSJF, SRPTOracle, Fairway):
    register_policy(_cls)


class PolicyError(ValueError):
    """An unknown policy name or bad policy options."""


def policy_class(name: str) -> type[QueuePolicy]:
    """The class registered as ``name``, or imported from ``module:Class`` / ``module.Class``."""
    return resolve_class(name, POLICIES, QueuePolicy, "policy", PolicyError)


def make_policy(
    name: str, *, clock: Clock, cost: CostModel, block_size: int = 16, **kwargs: Any
) -> QueuePolicy:
    cls = policy_class(name)
    try:
        return cls(clock, cost, block_size, **kwargs)
    except TypeError as e:
        raise PolicyError(f"bad options for policy {name!r}: {e}") from e


__all__ = [
    "FAIR",
    "FAST",
    "Admission",
    "Fairway",
    "FairwayConfig",
    "POLICIES",
    "PolicyError",
    "QueuePolicy",
    "QueuedRequest",
    "make_policy",
    "policy_class",
    "register_policy",
]
