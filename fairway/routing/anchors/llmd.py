"""llm-d's inference scheduler as the ``llmd`` anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class LLMD(RouterPolicy):
    """``llmd``: llm-d's inference scheduler, weighted scorers, highest wins.

    score_j = w_prefix * matched blocks / prompt blocks
            + w_queue * (maxQ - q_j) / (maxQ - minQ)   (1 for everyone when all q are equal)
            + w_kv * (1 - kv_usage_j)
    where q_j is j's waiting queue (outstanding - running, llm-d's queue scorer reads the
    engine's waiting-queue size). Ties by id. ``last_scores`` holds the scores.

    Options: w_prefix = 3, w_queue = 2, w_kv = 2.
    """

    name = "llmd"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        w_prefix: float = 3.0,
        w_queue: float = 2.0,
        w_kv: float = 2.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        self.w_prefix = float(w_prefix)
        self.w_queue = float(w_queue)
        self.w_kv = float(w_kv)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        nblocks = req.prompt_tokens // self.block_size
        qs = [max(0, s.outstanding - s.running) for s in ss]
        qmax, qmin = max(qs), min(qs)
        scores: dict[int, float] = {}
        for s, q in zip(ss, qs, strict=True):
            prefix = min(1.0, s.matched_blocks / nblocks) if nblocks else 0.0
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            scores[s.replica] = self.w_prefix * prefix + self.w_queue * queue + self.w_kv * (1.0 - s.kv_usage)
        order = sorted(scores, key=lambda j: (-scores[j], j))
        self.last_scores = scores
        self.last_reason = "score"
        return ranks_of(order[:1], order[1:])


__all__ = ["LLMD"]
