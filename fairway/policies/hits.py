"""Keep every waiting request's cached-prefix length current from cache events.

Why: a waiting request's cached prefix c_r grows when a sibling's prefill stores the blocks it
needs and shrinks when eviction drops one. Rescanning every queued prompt at each decision is
O(queue x prompt blocks). Instead the tracker indexes, per block hash, the waiting requests whose
cached prefix contains it (``_members``) or whose next uncached block it is (``_frontier``), and
updates only the requests an event touches.

Complexity: ``add`` is O(hit blocks); a stored event costs O(requests waiting on that hash +
blocks newly matched); a removed event costs O(requests holding it + blocks they lose). Chained
hashes name their position, so a hash sits at the same index in every prompt that has it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice, takewhile


class HitTracker:
    """Longest cached prefix (in blocks) of each tracked request, kept equal to a fresh walk."""

    __slots__ = ("_contains", "_hashes", "_hit", "_members", "_frontier", "_on_change")

    def __init__(
        self,
        contains: Callable[[int], bool],
        on_change: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self._contains = contains
        self._hashes: dict[int, Sequence[int]] = {}
        self._hit: dict[int, int] = {}
        self._members: dict[int, set[int]] = {}
        self._frontier: dict[int, set[int]] = {}
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._hit)

    def hit(self, key: int) -> int:
        return self._hit[key]

    @property
    def frontier(self) -> Mapping[int, set[int]]:
        """Block hash -> the keys whose first uncached block it is (a live, read-only view:
        callers look up, never write). O(1)."""
        return self._frontier

    def add(self, key: int, hashes: Sequence[int]) -> int:
        """Track ``key`` whose cacheable prompt blocks are ``hashes``; return its hit in blocks."""
        if key in self._hit:
            raise KeyError(f"request {key} already tracked")
        self._hashes[key] = hashes
        self._hit[key] = 0
        self._advance(key, notify=False)
        return self._hit[key]

    def remove(self, key: int) -> None:
        hashes = self._hashes.pop(key)
        hit = self._hit.pop(key)
        self._leave(hashes, 0, hit, key)
        if hit < len(hashes):
            self._discard(self._frontier, hashes[hit], key)

    def on_stored(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            keys = self._frontier.pop(h, None)
            if keys:
                for key in keys:
                    self._advance(key, notify=True, frontier_dropped=True)

    def on_removed(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            keys = self._members.get(h)
            if not keys:
                continue
            for key in list(keys):
                self._truncate(key, h)

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _discard(index: dict[int, set[int]], h: int, key: int) -> None:
        s = index.get(h)
        if s is not None:
            s.discard(key)
            if not s:
                del index[h]

    def _leave(self, hashes: Sequence[int], start: int, stop: int, key: int) -> None:
        """``_discard(_members, h, key)`` for every h in ``hashes[start:stop]``, inlined (a
        request leaves the member sets of its whole hit when admitted). O(stop - start)."""
        members = self._members
        get = members.get
        for h in islice(hashes, start, stop):
            s = get(h)
            if s is not None:
                s.discard(key)
                if not s:
                    del members[h]

    def _advance(self, key: int, notify: bool, frontier_dropped: bool = False) -> None:
        hashes = self._hashes[key]
        old = hit = self._hit[key]
        n = len(hashes)
        if hit < n and not frontier_dropped:
            self._discard(self._frontier, hashes[hit], key)
        # the walk runs in takewhile (no interpreted loop per probe), then indexes what it found
        hit += len(list(takewhile(self._contains, islice(hashes, hit, None))))
        members = self._members
        get = members.get
        for h in islice(hashes, old, hit):
            keys = get(h)
            if keys is None:
                members[h] = {key}
            else:
                keys.add(key)
        self._hit[key] = hit
        if hit < n:
            self._frontier.setdefault(hashes[hit], set()).add(key)
        if notify and hit != old and self._on_change is not None:
            self._on_change(key, old, hit)

    def _truncate(self, key: int, h: int) -> None:
        hashes = self._hashes[key]
        old = self._hit[key]
        # position of h: chained hashes are unique per position, search backwards from the hit
        pos = old - 1
        while pos >= 0 and hashes[pos] != h:
            pos -= 1
        if pos < 0:
            return
        self._leave(hashes, pos, old, key)
        if old < len(hashes):
            self._discard(self._frontier, hashes[old], key)
        self._hit[key] = pos
        self._frontier.setdefault(hashes[pos], set()).add(key)
        if self._on_change is not None:
            self._on_change(key, old, pos)
