"""AIBrix's prefix-cache router as the ``aibrix`` anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class AIBrix(RouterPolicy):
    """``aibrix``: AIBrix's prefix-cache router.

    Rule: the load is running requests. If max - min running > ``imbalance_abs_count``, only
    the least-loaded replicas are considered (``"imbalanced"``). Among the considered replicas
    with a match, best match first (ties by load, then id), the first whose load <= mean +
    ``std_factor`` * sigma (population mean and standard deviation over all candidates) wins
    (``"affinity"``). If none qualifies, the least-loaded considered replica
    (``"least-loaded"``). AIBrix picks at random among equally least-loaded pods; we take the
    best match among them, then the id. The others follow by (load, -match, id).

    Options: imbalance_abs_count = 8, std_factor = 1.0.
    """

    name = "aibrix"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        imbalance_abs_count: int = 8,
        std_factor: float = 1.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        self.imbalance_abs_count = imbalance_abs_count
        self.std_factor = float(std_factor)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        run = [s.running for s in ss]
        lo, hi = min(run), max(run)
        imbalanced = hi - lo > self.imbalance_abs_count
        cand = [s for s in ss if s.running == lo] if imbalanced else ss
        mean = sum(run) / len(run)
        sigma = math.sqrt(sum((r - mean) ** 2 for r in run) / len(run))
        limit = mean + self.std_factor * sigma
        pick: ReplicaState | None = None
        for s in sorted(cand, key=lambda s: (-s.matched_blocks, s.running, s.replica)):
            if s.matched_blocks <= 0:
                break
            if s.running <= limit:
                pick = s
                break
        if pick is None:
            pick = min(cand, key=lambda s: (s.running, -s.matched_blocks, s.replica))
            self.last_reason = "imbalanced" if imbalanced else "least-loaded"
        else:
            self.last_reason = "imbalanced" if imbalanced else "affinity"
        rest = sorted((s for s in ss if s.replica != pick.replica),
                      key=lambda s: (s.running, -s.matched_blocks, s.replica))
        return ranks_of([pick.replica], (s.replica for s in rest))


__all__ = ["AIBrix"]
