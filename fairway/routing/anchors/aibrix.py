"""AIBrix's prefix-cache router as the ``aibrix`` anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import shuffled
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class AIBrix(RouterPolicy):
    """``aibrix``: AIBrix's ``prefix-cache`` routing algorithm (its local-index mode).

    Where: vllm-project/aibrix, ``pkg/plugins/gateway/algorithms/prefix_cache.go``
    (``routeOriginal``, ``getTargetPodListOnLoadImbalance``, ``getTargetPodFromMatchedPods``),
    ``least_request.go`` (``getRequestCounts``, ``selectTargetPodWithLeastRequestCount``),
    ``util.go`` (``mean``, ``standardDeviation``), ``pkg/utils/prefixcacheindexer/hash.go``
    (the match percentages), ``pkg/cache/cache_trace.go`` (the load counter); read at commit
    e3e10f9 (August 2026).

    Rule, in our words. The load of a pod is the gateway's own count of the requests it routed
    there and has not seen finish (``realtime_num_requests_running``: +1 when routed, -1 when the
    response is done; here ``outstanding``), not the engine's running count.

    1. Imbalance: if max - min load over the pods > ``imbalance_abs_count``, only the pods with
       the minimum load are matched (``"imbalanced"``).
    2. Match: each of those pods gets its match percentage, (matched blocks * 100) // (the
       prompt's full blocks), in integers; pods with no matched block are left out.
    3. The matched pods are shuffled, then stably sorted by percentage descending and load
       ascending (so equal pairs stay in random order); the first whose load <= mean +
       ``std_factor`` * sigma wins (``"affinity"``), with mean and sigma the load's mean and
       *sample* standard deviation (n - 1) over all pods.
    4. If no pod matched or none passes, the least-loaded pod among all pods, at random among
       equals (``"least-loaded"``).

    The others follow by (load, -match, id).

    Defaults (AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT and
    AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR): imbalance_abs_count = 8, std_factor = 1.

    What differs from the original: AIBrix hashes blocks of its own tokenizer's output (by
    default one "token" per character, AIBRIX_PREFIX_CACHE_BLOCK_SIZE per block) and indexes its
    own routing decisions; we match the host index's blocks of tokens, which is
    capacity-bounded and corrected by the engines' reports. The KV-event-sync mode is not
    modelled. With several gateway instances AIBrix sums their counters every 100 ms; here each
    router instance counts its own (the host's ``--routers`` view decides).

    Complexity: O(R log R) per decision.
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

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        load = [s.outstanding for s in ss]
        lo, hi = min(load), max(load)
        imbalanced = hi - lo > self.imbalance_abs_count
        cand = [s for s in ss if s.outstanding == lo] if imbalanced else ss
        n = len(load)
        mean = sum(load) / n
        sigma = math.sqrt(sum((x - mean) ** 2 for x in load) / (n - 1)) if n > 1 else 0.0
        limit = mean + self.std_factor * sigma
        nb = req.prompt_tokens // self.block_size
        matched = [s for s in cand if s.matched_blocks > 0 and nb > 0]
        pct = {s.replica: min(s.matched_blocks, nb) * 100 // nb for s in matched}
        pick: ReplicaState | None = None
        order = sorted(shuffled(self.rng, matched), key=lambda s: (-pct[s.replica], s.outstanding)) if matched else []
        for s in order:
            if s.outstanding <= limit:
                pick = s
                break
        if pick is None:
            least = [s for s in ss if s.outstanding == lo]
            pick = least[int(self.rng.integers(len(least)))] if len(least) > 1 else least[0]
            reason = "imbalanced" if imbalanced else "least-loaded"
        else:
            reason = "imbalanced" if imbalanced else "affinity"
        rest = sorted((s for s in ss if s is not pick), key=lambda s: (s.outstanding, -s.matched_blocks, s.replica))
        return Ranking(ranks_of([pick.replica], (s.replica for s in rest)), reason)


__all__ = ["AIBrix"]
