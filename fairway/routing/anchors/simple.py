"""The load-only anchors: ``round-robin`` and ``pow2`` (Ray Serve's default router).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import pow2_ranks
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class RoundRobin(RouterPolicy):
    """``round-robin``: the next replica in id order, cycling; the others follow in cyclic order.

    The trivial baseline. The counter is the policy's own state, so a host that ranks twice for
    one request advances it twice.
    """

    name = "round-robin"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16, rng: np.random.Generator | None = None):
        super().__init__(clock, cost, block_size, rng)
        self._i = 0

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ids = [s.replica for s in by_id(states)]
        k = self._i % len(ids)
        self._i += 1
        order = ids[k:] + ids[:k]
        return Ranking(ranks_of(order[:1], order[1:]), "round-robin")


class Pow2(RouterPolicy):
    """``pow2``: Ray Serve's default, power of two choices on queue length.

    Two distinct replicas drawn at random from the injected ``rng``; the one with fewer
    outstanding requests first (ties by id). Both form the first rank (Ray probes the pair and
    takes the shorter queue); the rest follow by queue length.
    """

    name = "pow2"

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        return Ranking(pow2_ranks(self.rng, by_id(states)), "pow2")


__all__ = ["Pow2", "RoundRobin"]
