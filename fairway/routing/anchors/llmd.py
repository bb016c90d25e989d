"""llm-d's inference scheduler: ``llmd`` (its recommended "optimized baseline" configuration, 2026)
and ``llmd-baseline`` (the 3/2/2 weighted scorers, the router chart's default profile).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import shuffled
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

#: The chunk llm-d's calibration prefills alone to measure ``peakPrefillThroughput``: one unloaded
#: chunk of ``max_num_batched_tokens`` = 8192 tokens (the affinity filter's README).
CALIBRATION_CHUNK = 8192


def _max_score_order(rng: np.random.Generator, ss: Sequence[ReplicaState],
                     scores: dict[int, float]) -> list[int]:
    """llm-d's max-score picker order: shuffle, then a stable sort by score, highest first, so
    equal scores end up in random order. O(R log R)."""
    return [s.replica for s in sorted(shuffled(rng, ss), key=lambda s: -scores[s.replica])]


class LLMDBaseline(RouterPolicy):
    """``llmd-baseline``: llm-d's weighted scorers (prefix 3, queue 2, KV cache 2), highest wins.

    Where: llm-d/llm-d-router (formerly llm-d/llm-d-inference-scheduler),
    ``config/charts/routerlib/templates/_config.yaml`` (the chart's default profile without the
    latency predictor: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3),
    ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``,
    ``pkg/epp/config/loader/defaults.go`` (a profile without a picker gets the max-score picker),
    ``pkg/epp/framework/plugins/scheduling/picker/maxscore/picker.go``; read at commit ebab687
    (August 2026).

    score_j = w_prefix * matched blocks / prompt blocks
            + w_queue * (maxQ - q_j) / (maxQ - minQ)   (1 for everyone when all q are equal)
            + w_kv * (1 - kv_usage_j)
    where q_j is j's waiting queue (outstanding - running, llm-d's queue scorer reads the
    engine's waiting-queue size). The max-score picker shuffles the endpoints and sorts them
    stably by score, so ties go at random (from ``self.rng``). The ``Ranking`` holds the scores.

    What differs from the original: the prefix scorer's index (llm-d hashes 64-token blocks of its
    own decisions, or reads KV events in its precise mode) is the host's; the queue and KV usage
    are the engines' as the router last saw them.

    Options: w_prefix = 3, w_queue = 2, w_kv = 2.
    """

    name = "llmd-baseline"

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

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        nblocks = req.prompt_tokens // self.block_size
        qs = [max(0, s.outstanding - s.running) for s in ss]
        qmax, qmin = max(qs), min(qs)
        scores: dict[int, float] = {}
        for s, q in zip(ss, qs, strict=True):
            prefix = min(1.0, s.matched_blocks / nblocks) if nblocks else 0.0
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            scores[s.replica] = self.w_prefix * prefix + self.w_queue * queue + self.w_kv * (1.0 - s.kv_usage)
        order = _max_score_order(self.rng, ss, scores)
        return Ranking(ranks_of(order[:1], order[1:]), "score", scores)


class LLMD(RouterPolicy):
    """``llmd``: llm-d's recommended configuration, the "optimized baseline" well-lit path:
    a prefix-cache affinity filter, then a token-load scorer, then the max-score picker.

    Where: llm-d/llm-d, ``guides/optimized-baseline/router/optimized-baseline.values.yaml`` (the
    profile: ``prefix-cache-affinity-filter`` at affinityThreshold 0.80, then
    ``token-load-scorer``; the producers ``approx-prefix-cache-producer`` and
    ``inflight-load-producer``); llm-d/llm-d-router,
    ``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go``,
    ``.../scheduling/scorer/tokenload/token_load.go``,
    ``.../requestcontrol/dataproducer/inflightload/producer.go`` and their READMEs; read at
    commit ebab687 (August 2026).

    Rule, in our words:

    1. Affinity filter: a replica is sticky when its prefix score (matched blocks / the prompt's
       blocks) >= ``affinity_threshold``. No sticky replica: all stay (``"no-affinity"``). With
       probability ``exploration`` (drawn from ``self.rng``) all stay (``"explore"``).
    2. Its load gate: each replica's TTFT estimate is its in-flight tokens /
       ``peak_prefill_tps``; if the best sticky estimate exceeds the best non-sticky one by more
       than ``max_ttft_penalty_s``, stickiness breaks and all stay (``"affinity-broken"``);
       otherwise only the sticky ones (``"affinity"``).
    3. Token-load scorer: score = 1 - min(1, tokens / ``queue_threshold_tokens``) (1 at no
       tokens), where tokens are the replica's in-flight tokens: the uncached prompt tokens of
       the requests routed there (prompt minus the match there when routed), held until the
       request's first token (``ReplicaState.active_prefill_tokens``; llm-d's default
       ``addEstimatedOutputTokens: false`` releases all of them at the first streamed chunk).
    4. Max-score picker: highest score, ties at random. The filtered-out replicas follow, also
       by score.

    Defaults: affinity_threshold = 0.80, exploration = 0 (the filter's default since 2026; it
    was 0.01), max_ttft_penalty_s = 18 (maxTTFTPenaltyMs 18000), queue_threshold_tokens =
    4194304. ``peak_prefill_tps`` defaults to this cost model's throughput on one unloaded
    8192-token chunk, which is how llm-d says to calibrate it (its own default, 15928 tok/s, is
    Qwen3-32B on 2x H100; 18 s of it is the guide's earlier ``maxTokensInFlightPenalty:
    286720`` tokens).

    What differs from the original: the prefix score comes from the host's index (llm-d's
    approximate producer hashes 64-token blocks of its own decisions, LRU-bounded per server),
    and the in-flight count is per router instance, as llm-d's is per EPP replica. The filter's
    TTFT gate reads the in-flight token estimate above (its default source), not llm-d's latency
    predictor.

    Complexity: O(R log R) per decision.
    """

    name = "llmd"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        affinity_threshold: float = 0.80,
        exploration: float = 0.0,
        max_ttft_penalty_s: float = 18.0,
        peak_prefill_tps: float | None = None,
        queue_threshold_tokens: int = 4194304,
    ):
        super().__init__(clock, cost, block_size, rng)
        if not 0.0 <= exploration <= 1.0:
            raise ValueError("exploration must be in [0, 1]")
        if max_ttft_penalty_s < 0:
            raise ValueError("max_ttft_penalty_s must be >= 0")
        if queue_threshold_tokens <= 0:
            raise ValueError("queue_threshold_tokens must be > 0")
        self.affinity_threshold = float(affinity_threshold)
        self.exploration = float(exploration)
        self.max_ttft_penalty_s = float(max_ttft_penalty_s)
        if peak_prefill_tps is None:
            peak_prefill_tps = CALIBRATION_CHUNK / cost.prefill_time(CALIBRATION_CHUNK, 0)
        if not peak_prefill_tps > 0:
            raise ValueError("peak_prefill_tps must be > 0")
        self.peak_prefill_tps = float(peak_prefill_tps)
        self.queue_threshold_tokens = int(queue_threshold_tokens)
        self.first_tokens = True  # the in-flight tokens are released at the first token

    def _sticky(self, req: RouteRequest, ss: list[ReplicaState]) -> tuple[list[ReplicaState], str]:
        """The affinity filter's survivors (steps 1 and 2 of the rule) and the reason."""
        if len(ss) <= 1 or self.affinity_threshold <= 0:
            return ss, "no-affinity"
        if self.exploration > 0 and self.rng.random() < self.exploration:
            return ss, "explore"
        nb = req.prompt_tokens // self.block_size
        sticky = [s for s in ss if nb and s.matched_blocks / nb >= self.affinity_threshold]
        if not sticky:
            return ss, "no-affinity"
        if self.max_ttft_penalty_s > 0 and len(sticky) < len(ss):
            keep = {s.replica for s in sticky}
            best_sticky = min(s.active_prefill_tokens for s in sticky)
            best_other = min(s.active_prefill_tokens for s in ss if s.replica not in keep)
            if (best_sticky - best_other) / self.peak_prefill_tps > self.max_ttft_penalty_s:
                return ss, "affinity-broken"
        return sticky, "affinity"

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        cand, reason = self._sticky(req, ss)
        cap = self.queue_threshold_tokens
        scores = {s.replica: 1.0 - min(cap, max(0, s.active_prefill_tokens)) / cap for s in ss}
        order = _max_score_order(self.rng, cand, scores)
        if len(cand) < len(ss):
            keep = set(order)
            order += _max_score_order(self.rng, [s for s in ss if s.replica not in keep], scores)
        return Ranking(ranks_of(order[:1], order[1:]), reason, scores)


__all__ = ["CALIBRATION_CHUNK", "LLMD", "LLMDBaseline"]
