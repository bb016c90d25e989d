"""Hash-ring anchors: ``consistent-hash``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import xxhash

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.routing.base import ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of

_U64 = (1 << 64) - 1
_RING_SEED = 0x52494E47  # "RING"
_NO_BLOCKS_SEED = 0x4E4F424C  # "NOBL"


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


__all__ = ["ConsistentHash"]
