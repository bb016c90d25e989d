"""SGLang's cache-aware router as the ``sglang`` anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import by_queue
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class SGLang(RouterPolicy):
    """``sglang``: SGLang's cache-aware router (sgl-router ``cache_aware`` policy).

    Rule: the load is outstanding requests. If max - min load > ``balance_abs_threshold`` and
    max > ``balance_rel_threshold`` * min, the system is imbalanced: the least-loaded replica
    (``"imbalanced"``). Otherwise, if the best match rate > ``cache_threshold``, the
    best-matched replica (``"affinity"``); otherwise the one with the smallest tree
    (``"smallest-tree"``). Ties (several best-matched or smallest) go to the lower load, then
    the id. The others follow by load. Like Ray, SGLang matches characters; we match blocks.

    Options: balance_abs_threshold = 64, balance_rel_threshold = 1.5, cache_threshold = 0.3.
    """

    name = "sglang"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ):
        super().__init__(clock, cost, block_size, rng)
        self.balance_abs_threshold = float(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.cache_threshold = float(cache_threshold)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        loads = [s.outstanding for s in ss]
        mx, mn = max(loads), min(loads)
        if mx - mn > self.balance_abs_threshold and mx > self.balance_rel_threshold * mn:
            self.last_reason = "imbalanced"
            cand = ss
        else:
            best = max(s.matched_blocks for s in ss)
            top = next(s for s in ss if s.matched_blocks == best)
            if best > 0 and self.match_rate(req, top) > self.cache_threshold:
                self.last_reason = "affinity"
                cand = [s for s in ss if s.matched_blocks == best]
            else:
                self.last_reason = "smallest-tree"
                small = min(s.index_blocks for s in ss)
                cand = [s for s in ss if s.index_blocks == small]
        pick = min(cand, key=by_queue).replica
        rest = sorted((s for s in ss if s.replica != pick), key=by_queue)
        return ranks_of([pick], (s.replica for s in rest))


__all__ = ["SGLang"]
