"""Ray Serve's ``PrefixCacheAffinityRouter`` as the ``ray-prefix`` anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import by_queue, pow2_ranks
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class RayPrefix(RouterPolicy):
    """``ray-prefix``: Ray Serve's ``PrefixCacheAffinityRouter`` (Ray 2.49+).

    Rule, in order:

    1. if max - min outstanding > ``imbalanced_threshold``: power of two choices (reason
       ``"imbalanced"``);
    2. else if the best match rate (matched tokens / prompt tokens) >= ``match_rate_threshold``:
       the replicas with the best match (``"affinity"``);
    3. else the replicas with the smallest index (``"smallest-tree"``);

    then the shortest queue among them (the set is the first rank, by outstanding then id).
    Ray matches characters of the prompt text in a tree shared by its routers; we match blocks
    of tokens, so the rate is matched block tokens over prompt tokens.

    Upstream: ray-project/ray ``python/ray/llm/_internal/serve/request_router/prefix_aware/
    prefix_aware_router.py`` (the tree: ``prefix_tree.py``). The choice within the set is not
    random: the router returns the whole set as one rank and Ray's
    ``RequestRouter._select_from_candidate_replicas`` (``python/ray/serve/_private/
    request_router/request_router.py``) takes the shortest (cached or probed) queue, keeping the
    first replica on a tie; the set is in a fixed order (the replicas' or the tree's tenants'
    insertion order), which the replica id stands for here. Only the imbalanced branch is
    random: Ray's pow2 draws two replicas and keeps the first drawn on a tie (``pow2_ranks``).

    Options: imbalanced_threshold = inf (Ray 2.60, ray-project/ray #59390; 10 before and in
    Ray's docs: ``ray-prefix[imbalanced_threshold=10]``), match_rate_threshold = 0.1.
    """

    name = "ray-prefix"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        imbalanced_threshold: float = math.inf,
        match_rate_threshold: float = 0.1,
    ):
        super().__init__(clock, cost, block_size, rng)
        if not imbalanced_threshold >= 0:
            raise ValueError("imbalanced_threshold must be >= 0")
        self.imbalanced_threshold = float(imbalanced_threshold)
        self.match_rate_threshold = float(match_rate_threshold)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        outs = [s.outstanding for s in ss]
        if max(outs) - min(outs) > self.imbalanced_threshold:
            return Ranking(pow2_ranks(self.rng, ss), "imbalanced")
        best = max(s.matched_blocks for s in ss)
        top = next(s for s in ss if s.matched_blocks == best)
        if best > 0 and self.match_rate(req, top) >= self.match_rate_threshold:
            reason = "affinity"
            cand = [s for s in ss if s.matched_blocks == best]
        else:
            reason = "smallest-tree"
            small = min(s.index_blocks for s in ss)
            cand = [s for s in ss if s.index_blocks == small]
        chosen = {s.replica for s in cand}
        rest = [s for s in ss if s.replica not in chosen]
        return Ranking(ranks_of([s.replica for s in sorted(cand, key=by_queue)],
                                (s.replica for s in sorted(rest, key=by_queue))), reason)


__all__ = ["RayPrefix"]
