"""Keep every waiting request's cached-prefix length current from cache events.

Why: a waiting request's cached prefix c_r grows when a sibling's prefill stores the blocks it
needs and shrinks when eviction drops one. Rescanning every queued prompt at each decision is
O(queue x prompt blocks). Instead the tracker indexes, per block hash, the waiting requests whose
cached prefix contains it (``_members``: the key, or a set when several share the block) or whose
next uncached block it is (``_frontier``), and updates only the requests an event touches.

Complexity: ``add`` is O(hit blocks); a stored event costs O(requests waiting on that hash +
blocks newly matched); a batch of removed events costs O(requests holding one of them x
removed hashes they hold + blocks they lose), with one truncation per request per batch (an
eviction frees a request's blocks tail first, so a batch cuts a waiting request one block at a
time: truncating once at the lowest cut does the same in one pass). Chained hashes name their
position, so a hash sits at the same index in every prompt that has it. The per-block index
updates run as ``map``/``filterfalse`` sweeps (a prompt is hundreds of blocks), not as an
interpreted loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from itertools import compress, filterfalse, islice, repeat, takewhile
from operator import eq


def each_step(on_change: Callable[[int, int, int], None], key: int, old: int, path: list[int]) -> None:
    """A cut reported step by step: ``on_change(key, old, new)`` for each hit of ``path`` in
    order, each step's new hit the next one's old. What a caller that does not fold a path
    receives. O(len(path))."""
    for new in path:
        on_change(key, old, new)
        old = new


class HitTracker:
    """Longest cached prefix (in blocks) of each tracked request, kept equal to a fresh walk.

    ``on_change(key, old, new)`` is called when a stored event grows a request's hit;
    ``on_cut(key, old, path)`` when a batch of removed events shrinks it, ``path`` being the hits
    it went through, event by event, ending at the new one (a decreasing list): what a caller
    that folds the intermediate values (a deadline that only moves earlier) needs. Without
    ``on_cut`` each step of the path is reported to ``on_change``.
    """

    __slots__ = ("_contains", "_hashes", "_hit", "_members", "_frontier", "_on_change", "_on_cut")

    def __init__(
        self,
        contains: Callable[[int], bool],
        on_change: Callable[[int, int, int], None] | None = None,
        on_cut: Callable[[int, int, list[int]], None] | None = None,
    ) -> None:
        self._contains = contains
        self._hashes: dict[int, Sequence[int]] = {}
        self._hit: dict[int, int] = {}
        # hash -> the key whose hit holds it, or the set of them when several do (rare: one
        # int per block instead of one set per block keeps a long prompt's index cheap)
        self._members: dict[int, int | set[int]] = {}
        self._frontier: dict[int, set[int]] = {}
        self.set_listeners(on_change, on_cut)

    def set_listeners(
        self,
        on_change: Callable[[int, int, int], None] | None,
        on_cut: Callable[[int, int, list[int]], None] | None = None,
    ) -> None:
        """Replace the callbacks (as the constructor takes them)."""
        self._on_change = on_change
        if on_cut is None and on_change is not None:
            on_cut = partial(each_step, on_change)
        self._on_cut = on_cut

    @property
    def contains(self) -> Callable[[int], bool]:
        """The cache view's membership test the tracker walks prompts with."""
        return self._contains

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
        """A batch of evictions, in order. Each request is cut once, at the lowest position of a
        removed hash still in its hit when that hash's event comes (the same end state as
        cutting event by event); ``path`` records the hit after each cut."""
        get = self._members.get
        paths: dict[int, list[int]] = {}
        hit_of, hashes_of = self._hit, self._hashes
        for h in hashes:
            v = get(h)
            if v is None:
                continue
            for key in v if type(v) is set else (v,):
                path = paths.get(key)
                cur = path[-1] if path is not None else hit_of[key]
                hs = hashes_of[key]
                # position of h: chained hashes are unique per position, search backwards from
                # the hit (the tail block, when the eviction runs tail first)
                pos = cur - 1
                while pos >= 0 and hs[pos] != h:
                    pos -= 1
                if pos < 0:
                    continue  # already cut below h by this batch
                if path is None:
                    paths[key] = [pos]
                else:
                    path.append(pos)
        for key, path in paths.items():
            self._cut(key, path)

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _discard(index: dict[int, set[int]], h: int, key: int) -> None:
        s = index.get(h)
        if s is not None:
            s.discard(key)
            if not s:
                del index[h]

    def _join(self, hashes: Sequence[int], start: int, stop: int, key: int) -> None:
        """Make ``key`` a member of every h in ``hashes[start:stop]``. O(stop - start): the new
        hashes in one ``update``, the shared ones (a few: prompts rarely wait on the same block)
        one by one."""
        members = self._members
        seg = hashes[start:stop]
        new = list(filterfalse(members.__contains__, seg))
        if len(new) < len(seg):
            for h in filter(members.__contains__, seg):
                v = members[h]
                if type(v) is set:
                    v.add(key)
                elif v != key:
                    members[h] = {v, key}
        if new:
            members.update(zip(new, repeat(key)))

    def _leave(self, hashes: Sequence[int], start: int, stop: int, key: int) -> None:
        """``key`` leaves the member sets of every h in ``hashes[start:stop]`` (a request leaves
        those of its whole hit when admitted). O(stop - start): the hashes ``key`` holds alone
        are popped in one sweep, the shared ones one by one."""
        if stop <= start:
            return
        members = self._members
        seg = hashes[start:stop]
        try:
            vals = list(map(members.__getitem__, seg))
        except KeyError:  # a hash without members (not a chained prompt): one by one
            vals = list(map(members.get, seg))
        alone = list(compress(seg, map(eq, vals, repeat(key))))
        deque(map(members.pop, alone, repeat(None)), maxlen=0)
        if len(alone) < len(seg):
            for h, v in compress(zip(seg, vals, strict=True), map(isinstance, vals, repeat(set))):
                v.discard(key)
                if len(v) > 1:
                    continue
                if v:
                    members[h] = next(iter(v))
                else:
                    members.pop(h, None)

    def _advance(self, key: int, notify: bool, frontier_dropped: bool = False) -> None:
        hashes = self._hashes[key]
        old = hit = self._hit[key]
        n = len(hashes)
        if hit < n and not frontier_dropped:
            self._discard(self._frontier, hashes[hit], key)
        # the walk runs in takewhile (no interpreted loop per probe), then indexes what it found
        hit += len(list(takewhile(self._contains, islice(hashes, hit, None))))
        if hit > old:
            self._join(hashes, old, hit, key)
        self._hit[key] = hit
        if hit < n:
            self._frontier.setdefault(hashes[hit], set()).add(key)
        if notify and hit != old and self._on_change is not None:
            self._on_change(key, old, hit)

    def _cut(self, key: int, path: list[int]) -> None:
        """Truncate ``key``'s hit to ``path[-1]`` (the lowest cut of a batch). O(blocks lost)."""
        hashes = self._hashes[key]
        old = self._hit[key]
        pos = path[-1]
        self._leave(hashes, pos, old, key)
        if old < len(hashes):
            self._discard(self._frontier, hashes[old], key)
        self._hit[key] = pos
        self._frontier.setdefault(hashes[pos], set()).add(key)
        if self._on_cut is not None:
            self._on_cut(key, old, path)
