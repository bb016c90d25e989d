"""The router's held queue: requests that every replica's gate refused for now, waiting at the
router for room instead of being answered 429 (docs/design.md, Flow control).

Why: a gate refuses a request when the work queued ahead of it reaches its wait bound. While
every replica is at that bound, the router holds the request and sends it when a replica has
room, rather than refusing it and leaving the client to retry blind; it refuses (429 with
Retry-After) only when the request cannot be served within its class's wait bound.

The order is the gate's: the same flow-control policy object (``ClassQueues``: strict tiers, then
fair sharing of prefill work between a tier's classes, then the inner policy, Fairway's lanes by
default, within a class), without a cache view, because a request's hit depends on the replica
it will go to: within a class Fairway's Fast lane is then the least prompt work, and its Fair lane
the requests that have waited long relative to their own prefill.

The host (``router/ingress.py``) probes with the head (``head``): sent with ``GenerateCall.ack``,
it is either accepted by a gate (``take``: it leaves the queue, and its class is charged its
prefill work) or refused (it stays, and the round stops until the host sees room again). A
request that gives up (its bound passed, or its client left) is ``drop``ped, uncharged.

Complexity: ``hold``/``take``/``drop`` O(1) plus the inner policy's O(1) column writes; ``head``
the class policy's ``select``: O(C) plus one inner ``select``, O(n) vectorised over that class's
held requests (``bench/decision.py --held`` measures it at 10,000 held).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import QueuedRequest
from fairway.policies.classes import ClassesConfig, ClassQueues

#: the most requests one router holds by default; beyond it a refused request is answered 429 at once
DEFAULT_MAX_HELD = 10_000


class HeldQueue:
    """The held requests of one router, in the flow-control order (module docstring)."""

    def __init__(self, clock: Clock, cost: CostModel, classes: ClassesConfig | None = None, inner: str = "fairway",
                 max_held: int = DEFAULT_MAX_HELD, block_size: int = 16,
                 inner_options: dict[str, Any] | None = None) -> None:
        if max_held < 0:
            raise ValueError("max_held must be >= 0")
        self.clock = clock
        self.classes = classes or ClassesConfig()
        self.policy = ClassQueues(clock, cost, block_size, classes=self.classes, inner=inner,
                                  inner_options=inner_options)
        self.max_held = max_held
        self._held: dict[int, tuple[float, str]] = {}  # rid -> (clock time held, class name; "" without classes)
        self.depth: Counter[str] = Counter()  # held requests per class
        self._seq = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, rid: int) -> bool:
        return rid in self._held

    @property
    def full(self) -> bool:
        return len(self._held) >= self.max_held

    def hold(self, rid: int, prompt_tokens: int, priority_class: str = "", tenant: str = "") -> bool:
        """Hold ``rid`` (a ``prompt_tokens``-token request of ``priority_class``, "" = the default);
        False, and nothing held, when ``max_held`` are held already. O(1)."""
        if self.full:
            return False
        now = self.clock.now()
        name = self.classes.resolve(priority_class) if self.classes.classes else ""
        self.policy.add(QueuedRequest(rid=rid, arrival_s=now, prompt_tokens=max(1, prompt_tokens), block_hashes=(),
                                      seq=self._seq, priority_class=name, tenant=tenant))
        self._seq += 1
        self._held[rid] = (now, name)
        self.depth[name] += 1
        return True

    def head(self) -> int | None:
        """The held request to send next (None when none is held); it stays held. See the module
        docstring for the cost."""
        req = self.policy.select()
        return None if req is None else req.rid

    def take(self, rid: int) -> float:
        """``rid`` was accepted by a replica: it leaves, and its class is charged its work; the
        seconds it was held. O(1)."""
        self.policy.admit(rid)
        return self._left(rid)

    def drop(self, rid: int) -> float:
        """``rid`` gives up (its wait bound passed, or its client left): it leaves uncharged; the
        seconds it was held. O(1)."""
        self.policy.remove(rid)
        return self._left(rid)

    def _left(self, rid: int) -> float:
        since, name = self._held.pop(rid)
        self.depth[name] -= 1
        if not self.depth[name]:
            del self.depth[name]
        return max(0.0, self.clock.now() - since)


__all__ = ["DEFAULT_MAX_HELD", "HeldQueue"]
