"""The exact prefix view while the engines' KV events are current, the approximate one otherwise.

Why: an exact index (``PrefixIndex`` in events mode) is only as good as the stream of events
that feeds it. When that stream stops (the shared view is unreachable, events were lost beyond
the log's retention, a router has just started and has no snapshot yet), the exact index goes
stale without knowing it, and a stale exact index is worse than the approximate one: it never
learns what it misses, while the approximate index keeps learning from every decision and every
cached-token report. So a router in events mode keeps both, writes every routing and report to
both, applies KV events to the exact one, and reads from the exact one only while the host says
its events are current (``use_exact``). Switching back and forth loses nothing: the approximate
index was kept up to date all along.

Tier events (which hashes an engine holds only in its host KV tier) go to the exact index alone;
``match_tiers`` on the approximate one reports no host hits (it has no tier information).

Cost: every write is done twice (an approximate ``record_routed`` is O(prompt blocks)); reads
cost what the active index costs. Memory: both indexes.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Sequence

from fairway.prefix_index import APPROX, EVENTS, PrefixIndex


class FallbackIndex:
    """An events-mode ``PrefixIndex`` with an approx-mode one behind it (see the module docstring).

    Reads (``match``, ``match_one``, ``sizes``, ...) go to the active index; writes go to both.
    Starts on the approximate index: the exact one is empty until a snapshot or events arrive.
    """

    __slots__ = ("exact", "approx", "_active")

    def __init__(self, num_replicas: int = 0, capacity_blocks: int | None = None) -> None:
        self.exact = PrefixIndex(num_replicas, mode=EVENTS)
        self.approx = PrefixIndex(num_replicas, mode=APPROX, capacity_blocks=capacity_blocks, pin_in_flight=True)
        self._active = self.approx

    # -- which view ----------------------------------------------------------------------------

    def use_exact(self, on: bool) -> None:
        """Read from the exact index (its events are current) or from the approximate one. O(1)."""
        self._active = self.exact if on else self.approx

    @property
    def mode(self) -> str:
        """The active index's mode: ``"events"`` or ``"approx"``."""
        return self._active.mode

    @property
    def num_replicas(self) -> int:
        return self.exact.num_replicas

    # -- reads: the active index ---------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> list[int]:
        return self._active.match(hashes)

    def match_tiers(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        return self._active.match_tiers(hashes)

    def match_one(self, replica: int, hashes: Sequence[int]) -> int:
        return self._active.match_one(replica, hashes)

    def holds(self, replica: int, h: int) -> bool:
        return self._active.holds(replica, h)

    def blocks(self, replica: int) -> KeysView[int]:
        return self._active.blocks(replica)

    def size(self, replica: int) -> int:
        return self._active.size(replica)

    def sizes(self) -> list[int]:
        return self._active.sizes()

    def capacity(self, replica: int) -> int | None:
        return self.approx.capacity(replica)

    def __len__(self) -> int:
        return len(self._active)

    # -- writes: both ------------------------------------------------------------------------

    def add_replica(self, capacity_blocks: int | None = None) -> int:
        j = self.exact.add_replica()
        self.approx.add_replica(capacity_blocks)
        return j

    def clear_replica(self, replica: int) -> None:
        self.exact.clear_replica(replica)
        self.approx.clear_replica(replica)

    def record_routed(self, replica: int, hashes: Sequence[int]) -> int:
        self.exact.record_routed(replica, hashes)
        return self.approx.record_routed(replica, hashes)

    def release(self, replica: int, hashes: Sequence[int]) -> None:
        self.exact.release(replica, hashes)
        self.approx.release(replica, hashes)

    def on_feedback(self, replica: int, hashes: Sequence[int], cached_tokens: int, block_size: int,
                    estimated_blocks: int | None = None) -> int:
        self.exact.on_feedback(replica, hashes, cached_tokens, block_size, estimated_blocks)
        return self.approx.on_feedback(replica, hashes, cached_tokens, block_size, estimated_blocks)

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        self.approx.set_capacity(replica, capacity_blocks)

    # -- the engines' KV events: the exact index ---------------------------------------------

    def on_kv_events(self, replica: int, events: Iterable[tuple[bool, int]]) -> None:
        self.exact.on_kv_events(replica, events)

    def replace_blocks(self, replica: int, hashes: Iterable[int], host_only: Iterable[int] = ()) -> None:
        self.exact.replace_blocks(replica, hashes, host_only)

    def on_tier_events(self, replica: int, events: Iterable[tuple[bool, int]]) -> None:
        self.exact.on_tier_events(replica, events)
