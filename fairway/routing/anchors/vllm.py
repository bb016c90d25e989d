"""vLLM production-stack's routers: the ``vllm-prefixaware`` anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of


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


__all__ = ["VLLMPrefixAware"]
