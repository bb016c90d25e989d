"""NVIDIA Dynamo's KV router as the ``dynamo`` anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class Dynamo(RouterPolicy):
    """``dynamo``: NVIDIA Dynamo's KV router cost, lowest wins.

    cost_j = overlap_weight * prefill_blocks_j + decode_blocks_j, where
    prefill_blocks_j = (uncached tokens of this request on j + queued prefill tokens on j) /
    block_size and decode_blocks_j = the KV blocks of j's active requests (``active_blocks``).
    Dynamo also adds the request's own new blocks to the decode term; that is the same on every
    replica here (we do not dedupe against active sequences), so it is left out. Ties by id;
    temperature 0 (Dynamo's default: deterministic argmin). ``last_scores`` holds the costs.

    Options: overlap_weight = 1.0.
    """

    name = "dynamo"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        overlap_weight: float = 1.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        self.overlap_weight = float(overlap_weight)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        bs = self.block_size
        costs: dict[int, float] = {}
        for s in ss:
            uncached = max(0, req.prompt_tokens - s.matched_blocks * bs)
            prefill_blocks = (uncached + s.queued_prefill_tokens) / bs
            costs[s.replica] = self.overlap_weight * prefill_blocks + s.active_blocks
        order = sorted(costs, key=lambda j: (costs[j], j))
        self.last_scores = costs
        self.last_reason = "cost"
        return ranks_of(order[:1], order[1:])


__all__ = ["Dynamo"]
