"""Hash-ring anchors: ``prefix-hash`` (a bounded-load prefix ring), ``session-hash`` (a ring keyed
on the session), and ``consistent-hash`` (an unbounded prefix ring, kept as an ablation).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np
import xxhash

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import RecentRoutes
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

_U64 = (1 << 64) - 1
_RING_SEED = 0x52494E47  # "RING"
_NO_BLOCKS_SEED = 0x4E4F424C  # "NOBL"
_SESSION_SEED = 0x53455353  # "SESS"


class HashRing:
    """A consistent-hash ring of replica ids, ``vnodes`` points each.

    Why: every ring anchor needs "the replicas in clockwise order from a key", skipping those
    absent from this call's candidates, so that a replica that is full or gone moves only its
    own keys. The ring holds every replica id seen so far; it is rebuilt only when a new id
    appears: O(R vnodes log(R vnodes)). ``order`` is O(log(R vnodes)) for the start plus the
    walk, which ends once every candidate is seen (expected O(R log R) points).
    """

    __slots__ = ("_ids", "_owners", "_points", "vnodes")

    def __init__(self, vnodes: int) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._ids: set[int] = set()
        self._points: list[int] = []
        self._owners: list[int] = []

    def _grow(self, ids: Sequence[int]) -> None:
        if self._ids.issuperset(ids):
            return
        self._ids.update(ids)
        pts = []
        for j in sorted(self._ids):
            for v in range(self.vnodes):
                data = j.to_bytes(8, "little", signed=True) + v.to_bytes(4, "little")
                pts.append((xxhash.xxh3_64_intdigest(data, seed=_RING_SEED), j))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [j for _, j in pts]

    def order(self, key: int, ids: Sequence[int]) -> list[int]:
        """The candidates ``ids`` in clockwise ring order from ``key``: the owner first."""
        self._grow(ids)
        start = bisect.bisect_right(self._points, key)
        n = len(self._owners)
        cand = set(ids)
        seen: dict[int, None] = {}
        for i in range(n):
            j = self._owners[(start + i) % n]
            if j in cand and j not in seen:
                seen[j] = None
                if len(seen) == len(cand):
                    break
        return list(seen)


def blocks_key(hashes: Sequence[int], n: int) -> int:
    """xxh3 of the first ``n`` block hashes (n >= 1). O(n)."""
    data = b"".join((h & _U64).to_bytes(8, "little") for h in hashes[:n])
    return xxhash.xxh3_64_intdigest(data)


def rid_key(rid: int) -> int:
    """A ring position spread by request id, for a request with nothing to key on. O(1)."""
    return xxhash.xxh3_64_intdigest(rid.to_bytes(8, "little", signed=True), seed=_NO_BLOCKS_SEED)


def session_key(session: str) -> int:
    """The ring position of a session id. O(len(session))."""
    return xxhash.xxh3_64_intdigest(session.encode(), seed=_SESSION_SEED)


class ConsistentHash(RouterPolicy):
    """``consistent-hash``: the hash of the prompt's first ``k`` blocks on a ring of replicas.

    An ablation, not a production router: no deployed router hashes a short prompt prefix
    without a load bound (``prefix-hash`` is the production form), so it stays out of "best
    anchor". It shows what affinity alone does: when every request shares its first blocks,
    all of them go to one replica.

    Rule: key = xxh3 of the first min(k, blocks) block hashes (a prompt shorter than k blocks
    uses the blocks it has); the owner is the first virtual node clockwise from the key, each
    replica holding ``vnodes`` points. A prompt with no full block has nothing to share, so it
    is spread by its request id (reason ``"no-blocks"``). The other replicas follow in ring
    order, which is where the key would move if its owner left: the consistency property.

    Options: k = 4 blocks, vnodes = 100 points per replica. Complexity: ``HashRing``, plus
    O(k) for the key.
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
        self._ring = HashRing(vnodes)

    def key(self, req: RouteRequest) -> int:
        """The request's ring position. O(k)."""
        n = min(self.k, len(req.block_hashes))
        return blocks_key(req.block_hashes, n) if n else rid_key(req.rid)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ids = [s.replica for s in by_id(states)]
        order = self._ring.order(self.key(req), ids)
        return Ranking(ranks_of(order[:1], order[1:]), "hash" if req.block_hashes else "no-blocks")


class PrefixHash(RouterPolicy):
    """``prefix-hash``: a prefix ring with a load bound, SGLang Model Gateway's ``prefix_hash``.

    Upstream (sgl-project/sglang ``sgl-model-gateway/src/policies/prefix_hash.rs``, now
    lightseekorg/smg ``model_gateway/src/policies/prefix_hash.rs``; the ring is
    ``worker/hash_ring.rs``, 150 virtual nodes per worker): the key is xxh3 of the prompt's
    first 256 tokens; the ring owner takes the request if its load (the gateway's in-flight
    count for it) is at most ``load_factor`` x (total load + 1) / workers, or if the total is 0.
    Otherwise it does not walk the ring: it takes the least-loaded worker among those within
    the bound (the first in worker order on a tie), and the owner only if none is.

    KubeAI's CHWBL (substratusai/kubeai ``internal/loadbalancer/balance_chwbl.go``) uses the
    same bound (``meanLoadFactor`` 125%, the +1 for the new request) but walks the ring
    clockwise to the first endpoint within it, and keys on the first 100 characters of the
    first user message, so past the system prompt. ``spill="walk"`` models the walk; the key
    here is always the prompt's first blocks (we see no messages).

    Here: the key is xxh3 of the block hashes covering the first ``prefix_tokens`` tokens (a
    shorter prompt uses its full blocks; one without a full block is spread by request id,
    reason ``"no-blocks"``); the load is ``outstanding``. Reasons: ``"ring"`` (the owner),
    ``"spill"`` (another replica), ``"overloaded"`` (all above the bound: the owner). Ties go
    by replica id, as the originals' are by worker order (deterministic). The others follow in
    ring order.

    Options: prefix_tokens = 256, load_factor = 1.25, vnodes = 150, spill = "least-loaded"
    (SMG) or "walk" (KubeAI). Complexity: ``HashRing`` plus O(prefix blocks + R).
    """

    name = "prefix-hash"
    SPILLS = ("least-loaded", "walk")

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        prefix_tokens: int = 256,
        load_factor: float = 1.25,
        vnodes: int = 150,
        spill: str = "least-loaded",
    ):
        super().__init__(clock, cost, block_size, rng)
        if prefix_tokens < 1 or not load_factor >= 1.0:
            raise ValueError("prefix_tokens must be >= 1 and load_factor >= 1")
        if spill not in self.SPILLS:
            raise ValueError(f"spill must be one of {', '.join(self.SPILLS)}")
        self.prefix_tokens = prefix_tokens
        self.load_factor = float(load_factor)
        self.spill = spill
        self._ring = HashRing(vnodes)

    def key(self, req: RouteRequest) -> int:
        """The request's ring position: its first ceil(prefix_tokens / block_size) blocks. O(k)."""
        n = min(-(-self.prefix_tokens // self.block_size), len(req.block_hashes))
        return blocks_key(req.block_hashes, n) if n else rid_key(req.rid)

    def load_ok(self, load: int, total: int, n: int) -> bool:
        """Within the bound: ``load <= load_factor * (total + 1) / n``, or nothing in flight."""
        return total == 0 or load <= self.load_factor * (total + 1) / n

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        load = {s.replica: s.outstanding for s in ss}
        total, n = sum(load.values()), len(ss)
        order = self._ring.order(self.key(req), list(load))
        owner = order[0]
        ok = [j for j in order if self.load_ok(load[j], total, n)]
        if not req.block_hashes:
            reason = "no-blocks"
        elif owner in ok:
            reason = "ring"
        else:
            reason = "spill" if ok else "overloaded"
        if owner in ok or not ok:
            pick = owner
        elif self.spill == "walk":
            pick = ok[0]
        else:
            pick = min(ok, key=lambda j: (load[j], j))
        return Ranking(ranks_of([pick], (j for j in order if j != pick)), reason)


class SessionHash(RouterPolicy):
    """``session-hash``: a ring keyed on the request's session, SGLang Model Gateway's
    ``consistent_hashing``.

    Upstream (lightseekorg/smg ``model_gateway/src/policies/consistent_hashing.rs``, formerly
    sgl-project/sglang ``sgl-model-gateway/src/policies/consistent_hashing.rs``): the key is
    the ``X-SMG-Routing-Key`` header (else the authorization, x-forwarded-for or cookie
    header), the worker is the ring owner (150 virtual nodes), with no load bound; a request
    with no key goes to a uniformly random worker. Its opt-in ``bounded_consistent_hashing``
    walks the ring to the first worker whose load is at most ``max_load_skew`` (1.5) x
    max(mean load, 1). vLLM production-stack's ``session`` router (vllm-project/production-stack
    ``src/vllm_router/routers/routing_logic.py``, ``SessionRouter``) is the same unbounded
    ring (uhashring) keyed on a configured header or body field, but a request without the key
    goes to the endpoint with the lowest QPS (requests it routed there in the last 60 s; an
    endpoint it never routed to first).

    Here: the key is ``RouteRequest.session`` (the workload's session in the simulator, the
    client's ``X-Session-Id`` header or OpenAI ``user`` field live). Defaults model SMG's
    ``consistent_hashing``: no bound, ``fallback="random"`` (a draw from ``self.rng``).
    ``max_load_skew=1.5`` gives ``bounded_consistent_hashing``; ``fallback="qps"`` gives
    production-stack's keyless rule. Load is ``outstanding``. Reasons: ``"session"``,
    ``"spill"`` (bounded, another replica), ``"no-session"``. The others follow in ring order
    (by id without a session).

    Options: vnodes = 150, max_load_skew = inf, fallback = "random", qps_window_s = 60.
    Complexity: ``HashRing`` plus O(len(session) + R).
    """

    name = "session-hash"
    FALLBACKS = ("random", "qps")

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        vnodes: int = 150,
        max_load_skew: float = math.inf,
        fallback: str = "random",
        qps_window_s: float = 60.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        if not max_load_skew >= 1.0:
            raise ValueError("max_load_skew must be >= 1")
        if fallback not in self.FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(self.FALLBACKS)}")
        self.max_load_skew = float(max_load_skew)
        self.fallback = fallback
        self._ring = HashRing(vnodes)
        self._recent = RecentRoutes(qps_window_s)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        ids = [s.replica for s in ss]
        if not req.session:
            if self.fallback == "qps":
                pick = self._recent.least(self.clock.now(), ids)
            else:
                pick = ids[int(self.rng.integers(len(ids)))]
            self._note(pick)
            return Ranking(ranks_of([pick], (j for j in ids if j != pick)), "no-session")
        order = self._ring.order(session_key(req.session), ids)
        pick, reason = order[0], "session"
        if not math.isinf(self.max_load_skew):
            load = {s.replica: s.outstanding for s in ss}
            total = sum(load.values())
            bound = self.max_load_skew * max(total / len(ids), 1.0)
            if total and load[pick] > bound:
                pick = next((j for j in order if load[j] <= bound), pick)
                if pick != order[0]:
                    reason = "spill"
        self._note(pick)
        return Ranking(ranks_of([pick], (j for j in order if j != pick)), reason)

    def _note(self, pick: int) -> None:
        if self.fallback == "qps":  # only production-stack's keyless rule reads the counts
            self._recent.note(self.clock.now(), pick)


__all__ = ["ConsistentHash", "HashRing", "PrefixHash", "SessionHash", "blocks_key", "rid_key", "session_key"]
