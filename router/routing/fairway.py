"""Fairway's replica choice (DESIGN.md section 3, "Cluster level").

For replica j: ĉ_rj the estimated cached tokens (matched blocks, capped at the cacheable prefix),
P_rj = cost.prefill_time(L_r - ĉ_rj, ĉ_rj) the prefill estimate, Q_j the queued prefill seconds
routed to j and not yet started.

- **Fast lane choice** (``"affinity"``): j* = argmax ĉ_rj, ties to the smaller Q_j, then the id.
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
    f * P_rj * (index blocks of j / index blocks of the fullest replica): a placement displaces
    cached work in proportion to its own prefill and to how full that replica's cache is; with
    f = 1 the displaced work is counted at par with the request's own. Measured across Mooncake,
    rag-spike, agentic and hotspot on 8 replicas in docs/benchmarks.md), footprint = "index"
    (the fullness in that term: index blocks / the fullest replica's; "kv": KV usage / the
    highest replica's, the memory running requests hold, which shrinks the evictable cache),
    affinity_ties = "id" (equal best match and equal Q_j: the lowest id, DESIGN.md's rule;
    "ttft": the better expected TTFT, footprint included, then fewer outstanding). The last two
    are opt-in: on agentic (8 replicas, 3 sessions/s) both together cut p99 from 9.2 s to 1.7 s,
    but on Mooncake x3 they raised it from 12.0 s to 21.5 s (docs/benchmarks.md, issue 3).
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
        footprint: str = "index",
        affinity_ties: str = "id",
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
        if affinity_ties not in ("id", "ttft"):
            raise ValueError("affinity_ties must be 'id' or 'ttft'")
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
        order = sorted(ttft, key=lambda j: (ttft[j], -cached[j], load[j], j))
        # j*: the best-cached replica, ties to the smaller Q_j, then the id (DESIGN.md), or with
        # affinity_ties="ttft" to the better expected TTFT (footprint term included), then fewer
        # outstanding: with id ties, a prefix every replica holds (agentic's shared preamble)
        # sends every new session to the lowest id while the queues are empty.
        if self.affinity_ties == "ttft":
            pos = {r: i for i, r in enumerate(order)}
            j = min(cached, key=lambda r: (-cached[r], ss_q[r], pos[r]))
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


__all__ = ["DEFAULT_THETA", "FairwayRouter"]
