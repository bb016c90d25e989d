"""Fairway's replica choice (DESIGN.md section 3, "Cluster level").

For replica j: ĉ_rj the estimated cached tokens (matched blocks, capped at the cacheable prefix),
P_rj = cost.prefill_time(L_r - ĉ_rj, ĉ_rj) the prefill estimate, Q_j the queued prefill seconds
routed to j and not yet started.

- **Fast lane choice** (``"affinity"``): j* = argmax ĉ_rj, ties to the smaller Q_j, then the
  better expected TTFT (below, footprint term included), then fewer outstanding requests.
  Route there if Q_j* <= theta * max(P_rj*, p_floor_s): the reuse is worth waiting for as long
  as the wait stays within the queue level's own promotion budget (theta times the request's
  prefill time, the same theta as the replica's Fast lane).
- **Otherwise, the Fair lane choice** (``"fair"``): argmin over j of Q_j + P_rj, the minimum
  expected TTFT; ties to the larger ĉ_rj, then fewer outstanding requests, then the id.
- When no replica holds any of the prompt (``"cold"``), j* carries no reuse, and the choice is
  the Fair lane's: the minimum expected TTFT.

The ranks are the choice first, then every other replica by expected TTFT Q_j + P_rj.
``last_scores`` holds each replica's expected TTFT.

Complexity: O(R log R) for R candidates, with one cost-model call (O(1)) per replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from router.clock import Clock
from router.cost_model import CostModel
from router.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

#: The replica queue's default promotion threshold (``router.policies.fairway.FairwayConfig.theta``).
DEFAULT_THETA = 12.0


class FairwayRouter(RouterPolicy):
    """``fairway``: affinity to the best-cached replica while its queue is short relative to the
    request's prefill time, else the minimum expected TTFT.

    Options: theta = 12 (the queue level's default), p_floor_s = 0 (DESIGN.md's router rule has
    no floor; a positive floor lets fully cached requests wait behind a longer queue for their
    hit, as P_floor does at the queue level), extra_work_weight = 0 (w > 0 adds
    w * (P_rj - min_j P_rj) to each replica's score: the prefill a placement adds beyond the
    cheapest one, which the requests queued behind it there also wait for. Measured on one
    workload only (docs/benchmarks.md), so it is off by default), footprint_weight = 1 (adds
    f * P_rj * (j's fullness relative to the fullest replica's, see footprint): a placement displaces
    cached work in proportion to its own prefill and to how full that replica's cache is; with
    f = 1 the displaced work is counted at par with the request's own. Measured across Mooncake,
    rag-spike, agentic and hotspot on 8 replicas in docs/benchmarks.md), footprint = "kv" (the
    fullness in that term: KV usage / the highest replica's, the memory running requests hold,
    which shrinks the evictable cache; "index": index blocks / the fullest replica's),
    affinity_ties = "ttft" (equal best match and equal Q_j: the better expected TTFT, footprint
    included, then fewer outstanding; "id": the lowest id, DESIGN.md's first rule; "hash": the
    rendezvous-hash winner for the prompt's first block after the match, so prompts sharing a
    deeper prefix land together and prompts sharing only the matched part spread; "kv": the
    lowest KV usage, then the better expected TTFT: a new session goes where memory is freest,
    whatever the footprint). The defaults of the last two were chosen by the
    worst case over agentic, hotspot, rag-spike and Mooncake on 8 replicas, against the best
    anchor at each load (docs/benchmarks.md, issue 3): "ttft" + "kv" is at most 2.1x the best
    anchor's p99 (Mooncake x3: 21.5 s against DESIGN.md's id ties' 12.0 s, its one regression),
    where "id" + "index" is 6.2x (agentic 3 sessions/s: 9.2 s, now 1.7 s) and leaves hotspot's
    busiest replica +81% over the mean (now +12%).
    """

    name = "fairway"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        theta: float = DEFAULT_THETA,
        p_floor_s: float = 0.0,
        extra_work_weight: float = 0.0,
        footprint_weight: float = 1.0,
        footprint: str = "kv",
        affinity_ties: str = "ttft",
    ):
        super().__init__(clock, cost, block_size, rng)
        if not theta > 0:
            raise ValueError("theta must be > 0")
        if not p_floor_s >= 0:
            raise ValueError("p_floor_s must be >= 0")
        self.theta = float(theta)
        self.p_floor_s = float(p_floor_s)
        if not extra_work_weight >= 0:
            raise ValueError("extra_work_weight must be >= 0")
        self.extra_work_weight = float(extra_work_weight)
        if not footprint_weight >= 0:
            raise ValueError("footprint_weight must be >= 0")
        self.footprint_weight = float(footprint_weight)
        if footprint not in ("index", "kv"):
            raise ValueError("footprint must be 'index' or 'kv'")
        self.footprint = footprint
        if affinity_ties not in ("id", "ttft", "hash", "kv"):
            raise ValueError("affinity_ties must be 'id', 'ttft', 'hash' or 'kv'")
        self.affinity_ties = affinity_ties

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> list[list[int]]:
        ss = by_id(states)
        cached = {s.replica: self.cached_tokens(req, s) for s in ss}
        prefill = {s.replica: self.cost.prefill_time(req.prompt_tokens - cached[s.replica], cached[s.replica])
                   for s in ss}
        least = min(prefill.values())
        w = self.extra_work_weight
        # expected TTFT, plus (optionally) the prefill this placement adds beyond the cheapest
        # one: work that every request queued behind it on that replica also waits for
        biggest = max(s.index_blocks for s in ss) or 1
        f = self.footprint_weight
        if self.footprint == "kv":
            kmax = max(s.kv_usage for s in ss) or 1.0
            fullness = {s.replica: s.kv_usage / kmax for s in ss}
        else:
            fullness = {s.replica: s.index_blocks / biggest for s in ss}
        # optional terms: the prefill this placement adds beyond the cheapest one (work every
        # request queued behind it there also waits for), and its prefill scaled by how full
        # that replica's cache is relative to the fullest (blocks it will displace)
        ttft = {s.replica: s.queued_prefill_s + prefill[s.replica] + w * (prefill[s.replica] - least)
                + f * prefill[s.replica] * fullness[s.replica]
                for s in ss}
        load = {s.replica: s.outstanding for s in ss}
        ss_q = {s.replica: s.queued_prefill_s for s in ss}
        # equal expected TTFT (idle replicas have Q = 0): more cache, then fewer outstanding
        # requests, then the id, so equal choices spread instead of piling on the lowest id
        size = {s.replica: s.index_blocks for s in ss}
        # exact ties (idle replicas): the emptier cache (SGLang's smallest tree for new prefixes),
        # so sequential cold prompts spread over the cluster's memory instead of one replica
        order = sorted(ttft, key=lambda j: (ttft[j], -cached[j], load[j], size[j], j))
        # j*: the best-cached replica, ties to the smaller Q_j, then (affinity_ties="ttft", the
        # default) the better expected TTFT (footprint term included), then fewer outstanding;
        # "id": the id (DESIGN.md's first rule). With id ties, a prefix every replica holds
        # (agentic's shared preamble) sends every new session to the lowest id while the queues
        # are empty. "kv": to the lowest KV usage, then the better expected TTFT; "hash": see
        # _hash_tie.
        if self.affinity_ties == "ttft":
            pos = {r: i for i, r in enumerate(order)}
            j = min(cached, key=lambda r: (-cached[r], ss_q[r], pos[r]))
        elif self.affinity_ties == "kv":
            pos = {r: i for i, r in enumerate(order)}
            kv = {s.replica: s.kv_usage for s in ss}
            j = min(cached, key=lambda r: (-cached[r], ss_q[r], kv[r], pos[r]))
        elif self.affinity_ties == "hash":
            j = self._hash_tie(req, cached, ss_q)
        else:
            j = min(cached, key=lambda r: (-cached[r], ss_q[r], r))
        if cached[j] == 0:
            self.last_reason = "cold"
            pick = order[0]
        elif ss_q[j] <= self.theta * max(prefill[j], self.p_floor_s):
            self.last_reason = "affinity"
            pick = j
        else:
            self.last_reason = "fair"
            pick = order[0]
        self.last_scores = ttft
        return ranks_of([pick], (r for r in order if r != pick))

    def _hash_tie(self, req: RouteRequest, cached: dict[int, int], q: dict[int, float]) -> int:
        """j* with affinity_ties="hash": among the replicas with the best match and, among those,
        the smallest Q_j, the rendezvous-hash winner for the prompt's first block after the
        match (its chained hash names the prompt up to that block; the last block when the match
        is capped at the cacheable prefix). Requests that share that deeper prefix land
        together, as consistent hashing places them; requests that share only the matched part
        (a preamble every replica holds) spread evenly. O(R)."""
        best = max(cached.values())
        tied = [r for r in cached if cached[r] == best]
        qmin = min(q[r] for r in tied)
        tied = [r for r in tied if q[r] == qmin]
        if len(tied) == 1 or not req.block_hashes:
            return min(tied)
        key = int(req.block_hashes[min(best // self.block_size, len(req.block_hashes) - 1)])
        data = (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
        return max(tied, key=lambda r: (xxhash.xxh3_64_intdigest(data, seed=r), -r))


__all__ = ["DEFAULT_THETA", "FairwayRouter"]
