"""Helpers shared by the anchors: queue order, power of two choices, and a router's recent
routing counts (production-stack's QPS).

Complexity: O(R log R) in the candidate replicas R (a sort).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

from fairway.routing.base import ReplicaState, ranks_of


def by_queue(s: ReplicaState) -> tuple[int, int]:
    """Sort key: fewer outstanding requests first, then the replica id."""
    return (s.outstanding, s.replica)


def pow2_ranks(rng: np.random.Generator, ss: Sequence[ReplicaState]) -> list[list[int]]:
    """Power of two choices on ``ss`` (sorted by id): two distinct random candidates form the
    first rank, the shorter queue (outstanding) first; on equal queues the one drawn first, as
    Ray takes the first of its random sample (``_select_from_candidate_replicas`` keeps a replica
    only on a strictly shorter queue), so a tie is random. The rest follow by queue, then id."""
    n = len(ss)
    if n == 1:
        return [[ss[0].replica]]
    a, b = (int(x) for x in rng.choice(n, size=2, replace=False))
    pair = sorted((ss[a], ss[b]), key=lambda s: s.outstanding)
    rest = sorted((s for i, s in enumerate(ss) if i != a and i != b), key=by_queue)
    return ranks_of([s.replica for s in pair], (s.replica for s in rest))



def shuffled(rng: np.random.Generator, ss: Sequence[ReplicaState]) -> list[ReplicaState]:
    """``ss`` in a random order drawn from ``rng``: sort this with a stable key and equal keys
    end up in random order, as in the originals that break ties at random (or by the iteration
    order of a hash map, which is as good as random to a caller). O(R)."""
    return [ss[int(i)] for i in rng.permutation(len(ss))]


class RecentRoutes:
    """How many requests a router sent to each replica in the last ``window_s`` seconds: the
    QPS that vLLM production-stack's fallback compares (``RoutingInterface._qps_routing`` in
    vllm-project/production-stack ``src/vllm_router/routers/routing_logic.py``, over the
    ``--request-stats-window`` of 60 s). Each policy counts its own picks, as each
    production-stack router process keeps its own request stats.

    Why a deque: ``note`` appends and ``least`` drops what left the window from the front,
    O(1) amortized per request; ``least`` is O(R) over the candidates.
    """

    __slots__ = ("_counts", "_log", "_seen", "window_s")

    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        self.window_s = float(window_s)
        self._log: deque[tuple[float, int]] = deque()
        self._counts: Counter[int] = Counter()
        self._seen: set[int] = set()

    def note(self, now: float, replica: int) -> None:
        """The router sent a request to ``replica`` at ``now``."""
        self._log.append((now, replica))
        self._counts[replica] += 1
        self._seen.add(replica)

    def count(self, now: float, replica: int) -> int:
        """Requests sent to ``replica`` within the window ending at ``now``."""
        self._expire(now)
        return self._counts[replica]

    def least(self, now: float, ids: Sequence[int]) -> int:
        """Production-stack's pick among ``ids`` (in order): the first replica never routed to,
        else the fewest requests in the window, the first on a tie."""
        self._expire(now)
        for j in ids:
            if j not in self._seen:
                return j
        return min(ids, key=lambda j: self._counts[j])

    def _expire(self, now: float) -> None:
        log, counts = self._log, self._counts
        while log and log[0][0] < now - self.window_s:
            counts[log.popleft()[1]] -= 1


__all__ = ["RecentRoutes", "by_queue", "pow2_ranks", "shuffled"]
