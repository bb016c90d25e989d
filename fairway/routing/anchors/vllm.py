"""vLLM production-stack's routers: the ``vllm-prefixaware`` and ``vllm-loadaware`` anchors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.anchors.common import RecentRoutes
from fairway.routing.anchors.hashing import HashRing, session_key
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


class VLLMPrefixAware(RouterPolicy):
    """``vllm-prefixaware``: vLLM production-stack's ``prefixaware`` router.

    Upstream (vllm-project/production-stack ``src/vllm_router/routers/routing_logic.py``,
    ``PrefixAwareRouter``; the trie is ``src/vllm_router/prefix/hashtrie.py``): the prompt is cut
    into 128-character chunks, hashed into a trie of the endpoints each request was sent to;
    the match length is 128 x the chunks matched along the path while some available endpoint
    holds them. If it is below ``--prefix-min-match-length`` (characters, default 0, added in
    production-stack #959), the request goes to the lowest-QPS endpoint (the QPS fallback of
    ``RecentRoutes``); otherwise to a random endpoint among those at the deepest node (all of
    them when nothing matched). No load term.

    Here: a random replica (from ``self.rng``) among those with the longest match in blocks
    (``"affinity"``; ``"random"`` when none matches); when the match is shorter than
    ``min_match`` characters, the lowest-QPS replica (``"qps"``). We match tokens, not
    characters, so a match of m blocks counts as m x block_size x ``chars_per_token``
    characters (4 characters a token, English BPE; so the upstream 128-character chunk is
    about two 16-token blocks). The others follow by match (descending), then id.

    Options: min_match = 0 characters (upstream default: off), chars_per_token = 4.0,
    qps_window_s = 60 (upstream ``--request-stats-window``). O(R).
    """

    name = "vllm-prefixaware"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        min_match: int = 0,
        chars_per_token: float = 4.0,
        qps_window_s: float = 60.0,
    ):
        super().__init__(clock, cost, block_size, rng)
        if min_match < 0 or not chars_per_token > 0:
            raise ValueError("min_match must be >= 0 and chars_per_token > 0")
        self.min_match = int(min_match)
        self.chars_per_token = float(chars_per_token)
        self._recent = RecentRoutes(qps_window_s)

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        best = max(s.matched_blocks for s in ss)
        now = self.clock.now()
        if best * self.block_size * self.chars_per_token < self.min_match:
            reason = "qps"
            pick = self._recent.least(now, [s.replica for s in ss])
        else:
            if best > 0:
                reason = "affinity"
                cand = [s for s in ss if s.matched_blocks == best]
            else:
                reason = "random"
                cand = ss
            pick = cand[int(self.rng.integers(len(cand)))].replica
        if self.min_match:
            self._recent.note(now, pick)
        rest = sorted((s for s in ss if s.replica != pick), key=lambda s: (-s.matched_blocks, s.replica))
        return Ranking(ranks_of([pick], (s.replica for s in rest)), reason)


class VLLMLoadAware(RouterPolicy):
    """``vllm-loadaware``: vLLM production-stack's ``loadaware`` router (production-stack #1035).

    Upstream (vllm-project/production-stack ``src/vllm_router/routers/routing_logic.py``,
    ``LoadAwareRouter``, a ``KvawareRouter`` that overrides the selection): LMCache's controller
    reports, per engine, how many of the prompt's tokens it holds. If no engine holds any, the
    request takes the upstream fallback: the session ring if the request names a session, else
    the lowest-QPS endpoint. Otherwise every endpoint is scored

        score = min(matched, prompt) / prompt - beta * (load - mean) / max(1, mean)

    with load = the router's in-flight requests there (prefilling plus decoding, from its own
    request stats) and the mean over the endpoints, and the highest score wins, ties to the
    first URL in lexicographic order. ``kv_aware_threshold`` is not applied. beta = 1.0 (the
    ``LOADAWARE_BETA`` environment variable overrides it).

    Here: matched = ``matched_blocks`` x block_size, load = ``outstanding``; ties go to the
    lowest replica id (the originals' fixed URL order); the session fallback is a 150-point
    ring (upstream uses uhashring). Reasons: ``"score"``, ``"session"``, ``"qps"``. The others
    follow by score (descending), then id. LMCache reports what the engines hold, so this
    anchor is meant for the exact (events) index; on the approximate one it sees the router's
    own decisions.

    Options: beta = 1.0, qps_window_s = 60, vnodes = 150. O(R log R).
    """

    name = "vllm-loadaware"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        beta: float = 1.0,
        qps_window_s: float = 60.0,
        vnodes: int = 150,
    ):
        super().__init__(clock, cost, block_size, rng)
        if not beta >= 0:
            raise ValueError("beta must be >= 0")
        self.beta = float(beta)
        self._recent = RecentRoutes(qps_window_s)
        self._ring = HashRing(vnodes)

    def scores(self, req: RouteRequest, ss: Sequence[ReplicaState]) -> dict[int, float]:
        """Each replica's score (see the class docstring). O(R)."""
        mean = sum(s.outstanding for s in ss) / len(ss)
        prompt = max(req.prompt_tokens, 1)
        return {s.replica: min(s.matched_blocks * self.block_size, req.prompt_tokens) / prompt
                - self.beta * (s.outstanding - mean) / max(1.0, mean) for s in ss}

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        ids = [s.replica for s in ss]
        now = self.clock.now()
        sc: dict[int, float] = {}
        if all(s.matched_blocks == 0 for s in ss):
            if req.session:
                reason = "session"
                order = self._ring.order(session_key(req.session), ids)
            else:
                reason = "qps"
                pick = self._recent.least(now, ids)
                order = [pick] + [j for j in ids if j != pick]
        else:
            reason = "score"
            sc = self.scores(req, ss)
            order = sorted(ids, key=lambda j: (-sc[j], j))
        self._recent.note(now, order[0])
        return Ranking(ranks_of(order[:1], order[1:]), reason, sc)


__all__ = ["VLLMLoadAware", "VLLMPrefixAware"]
