"""Helpers shared by the anchors: queue order and power of two choices.

Complexity: O(R log R) in the candidate replicas R (a sort).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fairway.routing.base import ReplicaState, ranks_of


def by_queue(s: ReplicaState) -> tuple[int, int]:
    """Sort key: fewer outstanding requests first, then the replica id."""
    return (s.outstanding, s.replica)


def pow2_ranks(rng: np.random.Generator, ss: Sequence[ReplicaState]) -> list[list[int]]:
    """Power of two choices on ``ss`` (sorted by id): two distinct random candidates form the
    first rank, the shorter queue (outstanding) first, ties by id; the rest follow by queue."""
    n = len(ss)
    if n == 1:
        return [[ss[0].replica]]
    a, b = (int(x) for x in rng.choice(n, size=2, replace=False))
    pair = sorted((ss[a], ss[b]), key=by_queue)
    rest = sorted((s for i, s in enumerate(ss) if i != a and i != b), key=by_queue)
    return ranks_of([s.replica for s in pair], (s.replica for s in rest))



def shuffled(rng: np.random.Generator, ss: Sequence[ReplicaState]) -> list[ReplicaState]:
    """``ss`` in a random order drawn from ``rng``: sort this with a stable key and equal keys
    end up in random order, as in the originals that break ties at random (or by the iteration
    order of a hash map, which is as good as random to a caller). O(R)."""
    return [ss[int(i)] for i in rng.permutation(len(ss))]


__all__ = ["by_queue", "pow2_ranks", "shuffled"]
