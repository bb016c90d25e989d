"""Queue policies: an open registry of names (STYLE.md #1).

``make_policy("fairway", clock=..., cost=..., theta=6)`` builds a registered policy;
``make_policy("my.module:MyPolicy", ...)`` imports a class by dotted path.
"""

from __future__ import annotations

import importlib
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
    if name in POLICIES:
        return POLICIES[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise PolicyError(f"cannot import policy class {name!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, QueuePolicy)):
            raise PolicyError(f"{name!r} is not a QueuePolicy subclass")
        return cls
    known = ", ".join(sorted(POLICIES))
    raise PolicyError(f"unknown policy {name!r}; known: {known}")


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
