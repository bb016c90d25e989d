"""Queue policies: an open registry of names (docs/design.md, Open registry).

``make_policy("fairway", clock=..., cost=..., theta=6)`` builds a registered policy;
``make_policy("my.module:MyPolicy", ...)`` imports a class by dotted path.
"""

from __future__ import annotations

from typing import Any

from fairway.clock import Clock, ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.policies.base import FAIR, FAST, Admission, QueuedRequest, QueuePolicy
from fairway.policies.baselines import (
    FCFS,
    HRRN,
    KLPM,
    LPM,
    VLLMSJF,
    DFSWeight,
    LPMAging,
    SRPTOracle,
)
from fairway.policies.classes import ClassesConfig, ClassQueues, ClassSpec
from fairway.policies.fairway import Fairway, FairwayConfig
from fairway.policies.flow_anchors import LLMDFlow, PriorityFCFS
from fairway.policies.peek import PEEK
from fairway.policies.prism import PRISM
from fairway.policies.svf import SVF, SVF1Bit
from fairway.registry import checked_spec, resolve_class

POLICIES: dict[str, type[QueuePolicy]] = {}


def register_policy(cls: type[QueuePolicy]) -> type[QueuePolicy]:
    """Register a policy class under its ``name`` (usable as a decorator)."""
    POLICIES[cls.name] = cls
    return cls


#: The product: Fairway's own queue policy (docs/design.md, Fairway queue policy).
PRODUCT_POLICIES: tuple[type[QueuePolicy], ...] = (Fairway,)
#: Flow control between request classes (docs/design.md, Flow control): the class policy wraps a
#: product policy per class; the anchors are baselines it is compared with.
FLOW_POLICIES: tuple[type[QueuePolicy], ...] = (ClassQueues,)
FLOW_ANCHORS: tuple[type[QueuePolicy], ...] = (PriorityFCFS, LLMDFlow)
#: Baselines, for comparison only: the engines' and papers' orders as keys (``baselines.py``;
#: docs/design.md, Queue baselines), ``srpt-oracle`` being a reference bound.
BASELINE_POLICIES: tuple[type[QueuePolicy], ...] = (FCFS, LPM, DFSWeight, HRRN, KLPM, LPMAging, VLLMSJF,
                                                    SRPTOracle)
#: Baselines too: published schedulers rebuilt from their descriptions (docs/design.md, SVF and
#: Sorted-F; PEEK and PRISM).
PUBLISHED_BASELINES: tuple[type[QueuePolicy], ...] = (PEEK, PRISM, SVF, SVF1Bit)

# the registry's listing order
for _cls in (*BASELINE_POLICIES, *PRODUCT_POLICIES, *PUBLISHED_BASELINES, *FLOW_POLICIES, *FLOW_ANCHORS):
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


def validated_policy(spec: str, options: dict[str, Any] | None = None, *, block_size: int = 16,
                     profile: str = DEFAULT_PROFILE) -> tuple[str, dict[str, Any]]:
    """``spec`` (``name`` or ``name[key=value;...]``) plus ``options`` as (name, options), checked
    by building the policy once (``registry.checked_spec``); ``PolicyError`` names the policy and
    the bad option."""
    cost = CostModel.from_profile(profile)
    return checked_spec(spec, options, lambda name, **o: make_policy(
        name, clock=ManualClock(), cost=cost, block_size=block_size, **o), PolicyError)


__all__ = [
    "FAIR",
    "FAST",
    "Admission",
    "ClassQueues",
    "ClassSpec",
    "ClassesConfig",
    "Fairway",
    "FairwayConfig",
    "POLICIES",
    "PolicyError",
    "QueuePolicy",
    "QueuedRequest",
    "make_policy",
    "policy_class",
    "validated_policy",
    "register_policy",
]
