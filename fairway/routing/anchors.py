"""The cluster-level anchors (docs/design.md, Anchors), each a router policy with its defaults.

Every anchor here reads the same ``ReplicaState`` fields, so they differ only by rule:

- the approximate ones (Ray, SGLang, AIBrix, production-stack) see ``matched_blocks`` from an
  index of the router's own decisions, Dynamo and llm-d's precise mode from engine events; the
  host picks the index mode, the rule is the same;
- matches are in blocks of tokens, where Ray, SGLang and production-stack match characters
  (docs/design.md, Block hashes in token units): a "match rate" is matched block tokens / prompt
  tokens;
- ties that the originals break at random or by map order go by replica id here, unless the
  rule itself is random (``pow2``'s sampling, ``vllm-prefixaware``), which draws from the
  injected ``rng``.

Complexity: every ``rank`` is O(R log R) in the number of candidate replicas R (a sort), plus
O(k) for ``consistent-hash``'s key and an expected O(R log R) ring walk.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np
import xxhash

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

_U64 = (1 << 64) - 1
_RING_SEED = 0x52494E47  # "RING"
_NO_BLOCKS_SEED = 0x4E4F424C  # "NOBL"


def _by_queue(s: ReplicaState) -> tuple[int, int]:
    return (s.outstanding, s.replica)


def pow2_ranks(rng: np.random.Generator, ss: Sequence[ReplicaState]) -> list[list[int]]:
    """Power of two choices on ``ss`` (sorted by id): two distinct random candidates form the
    first rank, the shorter queue (outstanding) first, ties by id; the rest follow by queue."""
    n = len(ss)
    if n == 1:
        return [[ss[0].replica]]
    a, b = (int(x) for x in rng.choice(n, size=2, replace=False))
    pair = sorted((ss[a], ss[b]), key=_by_queue)
    rest = sorted((s for i, s in enumerate(ss) if i != a and i != b), key=_by_queue)
    return ranks_of([s.replica for s in pair], (s.replica for s in rest))


class RoundRobin(RouterPolicy):
    """``round-robin``: the next replica in id order, cycling; the others follow in cyclic order.

    The trivial baseline. The counter is the policy's own state, so a host that ranks twice for
    one request advances it twice.
    """

    name = "round-robin"

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16, rng: np.random.Generator | None = None):
        super().__init__(clock, cost, block_size, rng)
        self._i = 0

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ids = [s.replica for s in by_id(states)]
        k = self._i % len(ids)
        self._i += 1
        order = ids[k:] + ids[:k]
        self.last_reason = "round-robin"
        return ranks_of(order[:1], order[1:])


class Pow2(RouterPolicy):
    """``pow2``: Ray Serve's default, power of two choices on queue length.

    Two distinct replicas drawn at random from the injected ``rng``; the one with fewer
    outstanding requests first (ties by id). Both form the first rank (Ray probes the pair and
    takes the shorter queue); the rest follow by queue length.
    """

    name = "pow2"

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        self.last_reason = "pow2"
        return pow2_ranks(self.rng, by_id(states))


class ConsistentHash(RouterPolicy):
    """``consistent-hash``: the hash of the prompt's first ``k`` blocks on a ring of replicas.

    Rule: key = xxh3 of the first min(k, blocks) block hashes (a prompt shorter than k blocks
    uses the blocks it has); the owner is the first virtual node clockwise from the key, each
    replica holding ``vnodes`` points. A prompt with no full block has nothing to share, so it
    is spread by its request id (reason ``"no-blocks"``). The other replicas follow in ring
    order, which is where the key would move if its owner left: the consistency property.

    The ring holds every replica id seen so far and the walk skips those not among the current
    candidates, so a replica missing from one call (full, or gone) moves only its own keys.

    Options: k = 4 blocks, vnodes = 100 points per replica. The ring is rebuilt only when a new
    replica id appears (O(R vnodes log(R vnodes))); a lookup is O(k + log(R vnodes)) plus the walk.
    """

    name = "consistent-hash"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        k: int = 4,
        vnodes: int = 100,
    ):
        super().__init__(clock, cost, block_size, rng)
        if k < 1 or vnodes < 1:
            raise ValueError("k and vnodes must be >= 1")
        self.k = k
        self.vnodes = vnodes
        self._ring_ids: set[int] = set()
        self._points: list[int] = []
        self._owners: list[int] = []

    def _ring(self, ids: Sequence[int]) -> None:
        if self._ring_ids.issuperset(ids):
            return
        self._ring_ids.update(ids)
        pts = []
        for j in sorted(self._ring_ids):
            for v in range(self.vnodes):
                data = j.to_bytes(8, "little", signed=True) + v.to_bytes(4, "little")
                pts.append((xxhash.xxh3_64_intdigest(data, seed=_RING_SEED), j))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [j for _, j in pts]

    def key(self, req: RouteRequest) -> int:
        """The request's ring position. O(k)."""
        n = min(self.k, len(req.block_hashes))
        if n == 0:
            return xxhash.xxh3_64_intdigest(req.rid.to_bytes(8, "little", signed=True), seed=_NO_BLOCKS_SEED)
        data = b"".join((h & _U64).to_bytes(8, "little") for h in req.block_hashes[:n])
        return xxhash.xxh3_64_intdigest(data)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ids = [s.replica for s in by_id(states)]
        self._ring(ids)
        self.last_reason = "hash" if req.block_hashes else "no-blocks"
        start = bisect.bisect_right(self._points, self.key(req))
        n = len(self._owners)
        cand = set(ids)
        seen: dict[int, None] = {}
        for i in range(n):
            j = self._owners[(start + i) % n]
            if j in cand and j not in seen:
                seen[j] = None
                if len(seen) == len(ids):
                    break
        order = list(seen)
        return ranks_of(order[:1], order[1:])


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

    Options: imbalanced_threshold = inf (Ray 2.60; 10 before), match_rate_threshold = 0.1.
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

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        outs = [s.outstanding for s in ss]
        if max(outs) - min(outs) > self.imbalanced_threshold:
            self.last_reason = "imbalanced"
            return pow2_ranks(self.rng, ss)
        best = max(s.matched_blocks for s in ss)
        top = next(s for s in ss if s.matched_blocks == best)
        if best > 0 and self.match_rate(req, top) >= self.match_rate_threshold:
            self.last_reason = "affinity"
            cand = [s for s in ss if s.matched_blocks == best]
        else:
            self.last_reason = "smallest-tree"
            small = min(s.index_blocks for s in ss)
            cand = [s for s in ss if s.index_blocks == small]
        chosen = {s.replica for s in cand}
        rest = [s for s in ss if s.replica not in chosen]
        return ranks_of([s.replica for s in sorted(cand, key=_by_queue)],
                        (s.replica for s in sorted(rest, key=_by_queue)))


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
        pick = min(cand, key=_by_queue).replica
        rest = sorted((s for s in ss if s.replica != pick), key=_by_queue)
        return ranks_of([pick], (s.replica for s in rest))


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


class VLLMPrefixAware(RouterPolicy):
    """``vllm-prefixaware``: vLLM production-stack's ``prefixaware`` router.

    Rule: a random replica (from the injected ``rng``) among those with the longest match, no
    load term (``"affinity"``); a random replica overall when none matches (``"random"``).
    Production-stack hashes 128-character chunks into a trie and picks at random among the
    endpoints at the deepest matched node; we match blocks of tokens. The others follow by
    match (descending), then id.
    """

    name = "vllm-prefixaware"

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        best = max(s.matched_blocks for s in ss)
        if best > 0:
            self.last_reason = "affinity"
            cand = [s for s in ss if s.matched_blocks == best]
        else:
            self.last_reason = "random"
            cand = ss
        pick = cand[int(self.rng.integers(len(cand)))].replica
        rest = sorted((s for s in ss if s.replica != pick), key=lambda s: (-s.matched_blocks, s.replica))
        return ranks_of([pick], (s.replica for s in rest))


__all__ = [
    "AIBrix",
    "ConsistentHash",
    "Dynamo",
    "LLMD",
    "Pow2",
    "RayPrefix",
    "RoundRobin",
    "SGLang",
    "VLLMPrefixAware",
    "pow2_ranks",
]
