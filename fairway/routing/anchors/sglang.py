"""SGLang's cache-aware routers: ``sglang`` (SGLang Model Gateway's ``cache_aware`` policy, 2026)
and ``sglang-classic`` (the sgl-router rule this project modelled before, with the smallest tree
below the match threshold).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import by_queue
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

#: Block hashes whose first holder ``sglang`` remembers (about 25 MB of dict at most): enough for
#: every distinct prompt block of an hour of the shared workloads on 8 replicas; past it the
#: oldest entries go first, as the gateway's LRU eviction drops the oldest tree nodes.
OWNER_CAPACITY = 1 << 18


class _CacheAware(RouterPolicy):
    """What both SGLang rules share: their options and the fleet-wide imbalance switch (max -
    min load > ``balance_abs_threshold`` and max > ``balance_rel_threshold`` * min, load =
    outstanding requests). O(R)."""

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

    def imbalanced(self, ss: Sequence[ReplicaState]) -> bool:
        loads = [s.outstanding for s in ss]
        mx, mn = max(loads), min(loads)
        return mx - mn > self.balance_abs_threshold and mx > self.balance_rel_threshold * mn


class SGLang(_CacheAware):
    """``sglang``: SGLang Model Gateway's ``cache_aware`` policy (SMG, 2026).

    Where: lightseekorg/smg (the gateway's home since it left sgl-project/sglang's
    ``sgl-model-gateway/``), ``model_gateway/src/policies/cache_aware.rs`` (rule),
    ``model_gateway/src/main.rs`` (the CLI defaults), ``crates/kv_index/src/string_tree.rs``
    (which tenant a match names); read at commit 73da68c (August 2026).

    Rule, in our words. The load of a worker is the gateway's own in-flight count for it
    (``outstanding``). Each decision:

    1. Fleet-wide switch: if max - min load > ``balance_abs_threshold`` and max >
       ``balance_rel_threshold`` * min over the workers, the least-loaded worker
       (``"imbalanced"``).
    2. Otherwise the longest prefix match in the gateway's approximate tree: if its match rate
       (matched / prompt) > ``cache_threshold``, the worker the tree names for that match
       (``"affinity"``), whatever its load. The tree names the tenant that first inserted the
       deepest matched node (the node's cached ``last_tenant``), so several equally matched
       workers do not share the traffic: the first one routed that prefix keeps it. We keep the
       same memory: the first replica this policy routed a request holding the matched prefix's
       last block to, if it still holds the match; otherwise a random one of the best-matched
       (the tree's fallback is a hash map's iteration order).
    3. Otherwise (a match at or below the threshold) the least-loaded worker
       (``"least-loaded"``). This replaced the smallest tree in December 2025 (sglang PR 14650).

    "Least-loaded" breaks ties by fewer requests processed (a per-worker counter of the requests
    this policy sent there, every branch counting), then the worker's index (SMG PR 1714, June
    2026): deterministic, not random. The others follow in that order.

    Defaults (the gateway CLI's, also its Python bindings'): balance_abs_threshold = 64,
    balance_rel_threshold = 1.5, cache_threshold = 0.3. (The Rust ``CacheAwareConfig::default``
    says 32, 1.1, 0.5, used only when a caller builds the policy without a config.)

    What differs from the original: the gateway matches characters of the prompt text (HTTP) or
    tokens (gRPC); we match blocks of tokens from the host's index, so a match rate is matched
    block tokens over prompt tokens, and the index (capacity-bounded, corrected by the engines'
    reports) can know more than the gateway's tree. SMG's two KV-usage triggers for the switch
    are off by default (thresholds 1.0) and not modelled, nor is its event-driven mode (gRPC with
    KV events). There is no per-request spill gate in ``cache_aware`` at this commit; SMG's
    ``prefix_hash`` policy has a per-request bound (load > 1.25 x mean), which is another
    anchor's.

    Complexity: O(R log R) per decision plus O(prompt blocks) to remember the first holders.
    """

    name = "sglang"

    def __init__(self, *args: object, **options: object):
        super().__init__(*args, **options)  # type: ignore[arg-type]
        self._processed: dict[int, int] = {}  # replica -> requests this policy sent there
        # block hash -> the first replica this policy sent a request holding it (the tree
        # node's first tenant); insertion-ordered, so the oldest go first past OWNER_CAPACITY
        self._owner: OrderedDict[int, int] = OrderedDict()

    def _key(self, s: ReplicaState) -> tuple[int, int, int]:
        """Least-loaded order: load, then requests processed, then id (SMG's tie-break)."""
        return (s.outstanding, self._processed.get(s.replica, 0), s.replica)

    def _tenant(self, req: RouteRequest, best: int, holders: list[ReplicaState]) -> ReplicaState:
        """The worker the tree names for a ``best``-block match among ``holders``: the first
        holder of the matched prefix's last block if it still holds the match, else a random
        holder."""
        owner = self._owner.get(req.block_hashes[best - 1]) if best <= len(req.block_hashes) else None
        for s in holders:
            if s.replica == owner:
                return s
        return holders[int(self.rng.integers(len(holders)))] if len(holders) > 1 else holders[0]

    def _remember(self, req: RouteRequest, pick: int) -> None:
        """The tree learns the prompt on ``pick``: blocks nobody held before are now its. O(blocks)."""
        owner = self._owner
        for h in req.block_hashes:
            if h not in owner:
                owner[h] = pick
        while len(owner) > OWNER_CAPACITY:
            owner.popitem(last=False)  # O(1), where deleting a plain dict's first key rescans

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        pick: ReplicaState
        if self.imbalanced(ss):
            reason = "imbalanced"
            pick = min(ss, key=self._key)
        else:
            best = max(s.matched_blocks for s in ss)
            holders = [s for s in ss if s.matched_blocks == best]
            if best > 0 and self.match_rate(req, holders[0]) > self.cache_threshold:
                reason = "affinity"
                pick = self._tenant(req, best, holders)
            else:
                reason = "least-loaded"
                pick = min(ss, key=self._key)
        self._processed[pick.replica] = self._processed.get(pick.replica, 0) + 1
        self._remember(req, pick.replica)
        rest = sorted((s for s in ss if s is not pick), key=self._key)
        return Ranking(ranks_of([pick.replica], (s.replica for s in rest)), reason)


class SGLangClassic(_CacheAware):
    """``sglang-classic``: sgl-router's ``cache_aware`` policy as it stood before December 2025.

    Where: sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs`` (before PR 14650).

    Rule: the load is outstanding requests. If max - min load > ``balance_abs_threshold`` and
    max > ``balance_rel_threshold`` * min, the system is imbalanced: the least-loaded replica
    (``"imbalanced"``). Otherwise, if the best match rate > ``cache_threshold``, the
    best-matched replica (``"affinity"``); otherwise the one with the smallest tree
    (``"smallest-tree"``). Ties (several best-matched or smallest) go to the lower load, then
    the id. The others follow by load. Like Ray, SGLang matches characters; we match blocks.
    The ``sglang`` anchor is the 2026 gateway's rule.

    Options: balance_abs_threshold = 64, balance_rel_threshold = 1.5, cache_threshold = 0.3.
    """

    name = "sglang-classic"

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        if self.imbalanced(ss):
            reason = "imbalanced"
            cand = ss
        else:
            best = max(s.matched_blocks for s in ss)
            top = next(s for s in ss if s.matched_blocks == best)
            if best > 0 and self.match_rate(req, top) > self.cache_threshold:
                reason = "affinity"
                cand = [s for s in ss if s.matched_blocks == best]
            else:
                reason = "smallest-tree"
                small = min(s.index_blocks for s in ss)
                cand = [s for s in ss if s.index_blocks == small]
        pick = min(cand, key=by_queue).replica
        rest = sorted((s for s in ss if s.replica != pick), key=by_queue)
        return Ranking(ranks_of([pick], (s.replica for s in rest)), reason)


__all__ = ["OWNER_CAPACITY", "SGLang", "SGLangClassic"]
