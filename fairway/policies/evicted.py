"""``EvictedBlocks``: a replica's memory of the context it computed: the last block of each prompt
it admitted (``lost_scope="turns"``), or the block hashes its prefix cache dropped most recently
(``lost_scope="evicted"``).

Why: a follow-up turn whose context the cache evicted between its turns arrives with a prefill
many times its own new tokens'. Fairway's deadline counts that lost prefix as cached
(``FairwayConfig.lost_blocks``), and needs to know which of a new prompt's blocks this replica
computed and lost; the cache itself has forgotten them. A bounded memory, oldest forgotten first,
as ARC's ghost lists remember what the cache evicted; one per replica, shared by the per-tenant and
per-class queues of a group (``QueueGroup``).

Complexity: ``add`` O(1) per hash (an ordered map; a hash added again moves to the newest);
membership O(1); memory O(capacity).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class EvictedBlocks:
    """At most ``capacity`` (> 0) block hashes (admitted prompts' ends, or evicted blocks), oldest
    forgotten first."""

    __slots__ = ("capacity", "_hashes")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        """Remember ``hashes`` as the newest (a prompt's end at its admission, or the blocks the cache
        dropped). O(hashes)."""
        known = self._hashes
        for h in hashes:
            if h in known:
                known.move_to_end(h)
            else:
                known[h] = None
        for _ in range(len(known) - self.capacity):
            known.popitem(last=False)

    def deepest(self, hashes: Sequence[int], start: int) -> int:
        """One past the deepest of ``hashes[start:]`` remembered, or ``start`` where none is. O(len)
        and, where none is (most arrivals), one pass in C: the disjointness test."""
        known = self._hashes
        if known.keys().isdisjoint(hashes[start:]):
            return start
        return next(i + 1 for i in range(len(hashes) - 1, start - 1, -1) if hashes[i] in known)

    def __contains__(self, h: object) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def oldest_first(self) -> list[int]:
        """The remembered hashes, oldest first (for tests and reports). O(capacity)."""
        return list(self._hashes)


__all__ = ["EvictedBlocks"]
