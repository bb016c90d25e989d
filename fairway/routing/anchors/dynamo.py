"""NVIDIA Dynamo's KV router as the ``dynamo`` anchor.

Upstream (ai-dynamo/dynamo, 2026; the router moved from ``lib/llm/src/kv_router/`` into the
``lib/kv-router`` crate): ``src/scheduling/selector.rs`` (``DefaultWorkerSelector``: the cost and
the pick), ``src/scheduling/config.rs`` (``KvRouterConfig`` defaults),
``src/sequences/single.rs`` and ``src/sequences/prompt_registry.rs`` (``ActiveSequences``: the
router's own per-worker record of the requests it sent, their block hashes and their prefill
tokens) and ``lib/llm/src/kv_router`` (the prefill mark on the first streamed token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class Dynamo(RouterPolicy):
    """``dynamo``: NVIDIA Dynamo's KV router cost, lowest wins.

    The rule, per worker j, in blocks (Dynamo's ``worker_logit``)::

        prefill_j = prefill_load_scale * max(0, (active_prefill_tokens_j + prompt_tokens) / block_size
                                                - overlap_score_credit * gpu_hit_j
                                                - host_cache_hit_weight * host_hit_j)
        decode_j  = unique_active_blocks_j + new_blocks_j
        cost_j    = prefill_j + decode_j

    - active_prefill_tokens_j: the uncached prompt tokens of the requests sent to j whose first
      token has not come (Dynamo adds them at routing and drops them when the response stream
      yields its first token: ``mark_prefill_completed``), so a request queued or prefilling
      on j weighs on it until then, not only until admission.
    - gpu_hit_j / host_hit_j: the request's matched prefix on j in the device tier and in the
      host (pinned CPU) tier after it; a host hit earns 0.75 of a GPU hit's credit.
    - unique_active_blocks_j: the distinct prompt blocks of j's active requests (Dynamo's
      ``ActiveSequences`` counts each block hash once, however many requests share it);
      new_blocks_j: this request's blocks past the longest prefix already active on j.
    - The pick: the minimum; equal minima are broken uniformly at random (Dynamo samples among
      them); ``router_temperature > 0`` samples a softmax over the costs scaled to their range,
      as Dynamo does. Draws come from ``self.rng``.

    Defaults, as Dynamo ships them: overlap_score_credit = 1.0, prefill_load_scale = 1.0 (the
    old ``overlap_score_weight``), host_cache_hit_weight = 0.75, router_temperature = 0.0;
    overlap_score_credit_decay and decode_active_request_weight are 0 there (off), and so are
    left out. In the simulator it reads the exact KV-event index by default
    (``default_index_mode``; Dynamo's ``use_kv_events`` defaults to true).

    What still differs: the events index here also counts prompts routed and not finished as
    held where they went (Dynamo's predict-on-route overlay is off by default); Dynamo's
    router-side queue (it parks requests when every worker is past 16x its batched-token
    budget) is not modelled; the Ray host learns of first tokens from the replicas' periodic
    stats, so it holds prefill tokens a little longer than Dynamo's stream hook does; a host
    that tracks no active blocks (``active_blocks`` unset) gets the summed ``active_blocks``
    with every prompt block counted as new. The ``Ranking``'s scores are the costs.
    """

    name = "dynamo"
    default_index_mode = "events"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        overlap_score_credit: float = 1.0,
        prefill_load_scale: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        router_temperature: float = 0.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        if not 0.0 <= overlap_score_credit <= 1.0:
            raise ValueError("overlap_score_credit must be in [0, 1]")
        if not 0.0 <= host_cache_hit_weight <= 1.0:
            raise ValueError("host_cache_hit_weight must be in [0, 1]")
        if not prefill_load_scale >= 0.0 or not router_temperature >= 0.0:
            raise ValueError("prefill_load_scale and router_temperature must be >= 0")
        self.overlap_score_credit = float(overlap_score_credit)
        self.prefill_load_scale = float(prefill_load_scale)
        self.host_cache_hit_weight = float(host_cache_hit_weight)
        self.router_temperature = float(router_temperature)
        self.host_tier = True  # a host-tier hit earns host_cache_hit_weight of a GPU hit's credit
        self.first_tokens = True  # prefill tokens held until the first token
        self.active_blocks = True  # decode cost from the distinct active blocks

    def cost_of(self, req: RouteRequest, s: ReplicaState) -> float:
        """Dynamo's cost of sending ``req`` to ``s`` (see the class docstring). O(1)."""
        bs = self.block_size
        host = s.host_blocks
        credit = self.overlap_score_credit * (s.matched_blocks - host) + self.host_cache_hit_weight * host
        raw = (s.active_prefill_tokens + req.prompt_tokens) / bs
        prefill = self.prefill_load_scale * max(0.0, raw - credit)
        if s.new_blocks is None:  # the host tracks no active blocks: summed, every block new
            return prefill + s.active_blocks + len(req.block_hashes)
        return prefill + s.unique_active_blocks + s.new_blocks

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        costs = {s.replica: self.cost_of(req, s) for s in ss}
        pick = self._sample(costs)
        rest = sorted((j for j in costs if j != pick), key=lambda j: (costs[j], j))
        return Ranking(ranks_of([pick], rest), "cost", costs)

    def _sample(self, costs: dict[int, float]) -> int:
        """Temperature 0: the lowest cost, equal minima uniformly at random. Otherwise Dynamo's
        softmax: weights exp(-(c - min) / ((max - min) * T)), uniform when all costs are equal.
        Candidates in id order. O(replicas)."""
        ids = list(costs)
        lo = min(costs.values())
        t = self.router_temperature
        if t == 0.0:
            ties = [j for j in ids if costs[j] == lo]
            return ties[0] if len(ties) == 1 else ties[int(self.rng.integers(len(ties)))]
        hi = max(costs.values())
        if hi == lo:
            return ids[int(self.rng.integers(len(ids)))]
        w = [math.exp(-(costs[j] - lo) / ((hi - lo) * t)) for j in ids]
        u = float(self.rng.random()) * sum(w)
        acc = 0.0
        for j, wj in zip(ids, w, strict=True):
            acc += wj
            if u <= acc:
                return j
        return ids[-1]


__all__ = ["Dynamo"]
