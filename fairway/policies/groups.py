"""``QueueGroup``: what a queue policy made of one inner queue policy per group (per tenant at a
replica's gate, ``replicas/tenants.py``; per request class, ``classes.py``) passes to every inner
queue or sums over them: the engine's cache events and memory view, the lanes, the promotions and
the memory guard's yields and acts, and the queued work.

Why one piece: the groupings differ in how they pick the next group, not in this fan-out. The
inner queues that remember lost context (Fairway's ``lost_blocks``: the blocks the cache evicted,
or the ends of the prompts admitted) share one such memory (``_share_evicted``).
Complexity: O(G) per call for G groups (cache events: O(G * hashes)).
"""

from __future__ import annotations

from collections.abc import Iterable

from fairway.memory_view import KVMemoryView
from fairway.policies.base import QueuePolicy


class QueueGroup:
    """Mixin over ``self.queues`` (group -> inner ``QueuePolicy``)."""

    queues: dict[str, QueuePolicy]

    def on_blocks_stored(self, hashes: Iterable[int]) -> None:
        hs = hashes if len(self.queues) == 1 else list(hashes)  # iterated once per group
        for q in self.queues.values():
            q.on_blocks_stored(hs)

    def on_blocks_removed(self, hashes: Iterable[int]) -> None:
        hs = hashes if len(self.queues) == 1 else list(hashes)
        for q in self.queues.values():
            q.on_blocks_removed(hs)

    def _share_evicted(self) -> None:
        """Let every inner queue that keeps a memory of lost context (Fairway's ``lost_blocks``)
        use the first such queue's: one replica's cache, one memory, however many tenants or
        classes. Evicted blocks are recorded by that queue alone (every queue sees every cache
        event); the ends of admitted prompts by the queue that admits them. Each grouping calls it
        whenever it adds queues (``ClassQueues`` once, at construction; ``TenantQueues`` as each
        tenant's queue is made), so a memory is shared before its first use. O(G)."""
        shared = None
        for q in self.queues.values():
            mine = getattr(q, "evicted", None)
            if mine is None:
                continue
            if shared is None:
                shared = mine
            elif mine is not shared:
                q.share_evicted(shared)  # type: ignore[attr-defined]

    def wants_memory_view(self) -> bool:
        return any(q.wants_memory_view() for q in self.queues.values())

    def memory_horizon_s(self) -> float:
        return max(q.memory_horizon_s() for q in self.queues.values())

    def attach_memory(self, view: KVMemoryView) -> None:
        for q in self.queues.values():
            q.attach_memory(view)

    def lane_sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for q in self.queues.values():
            for lane, n in q.lane_sizes().items():
                out[lane] = out.get(lane, 0) + n
        return out

    @property
    def promotions(self) -> int:
        return sum(getattr(q, "promotions", 0) for q in self.queues.values())

    @property
    def yields(self) -> int:
        return sum(getattr(q, "yields", 0) for q in self.queues.values())

    @property
    def lost_credits(self) -> int:
        return sum(getattr(q, "lost_credits", 0) for q in self.queues.values())

    @property
    def guard_acts(self) -> int:
        return sum(getattr(q, "guard_acts", 0) for q in self.queues.values())

    def queued_prefill_s(self) -> float:
        return sum(q.queued_prefill_s() for q in self.queues.values())

    def group_sizes(self) -> dict[str, int]:
        """Waiting requests per group (groups with none left out)."""
        return {g: len(q) for g, q in self.queues.items() if len(q)}


__all__ = ["QueueGroup"]
