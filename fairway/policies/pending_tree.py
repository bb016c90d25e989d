"""A radix tree over the waiting queue's cacheable block hashes: who is queued behind each block.

Why: the demand-aware policies (PEEK, PRISM) ask, per block, how many waiting requests need it
(``demand``), to find prefix-sharing clusters among the waiting requests and to tell the engine
which cached blocks queued work will read. A chained block hash names its whole prefix, so the
tree is keyed by hash: a node is one dict probe away, its parent is the previous block of any
prompt that holds it, and no child maps or path compression are needed.

Complexity: ``add`` / ``remove`` O(blocks of the request); ``demand`` O(1); ``dual_walk``
O(sum of the requests' hits + tree nodes probed), each node probing the cache at most once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

ROOT = -1  # the parent of every first block (in ``check``)


class PendingTree:
    """Per-block demand counts of the waiting requests' cacheable prefixes.

    Invariants (``check``): a node's count is the requests ending at it plus its children's
    counts; a child's count never exceeds its parent's; every node has a count >= 1.
    """

    __slots__ = ("_count", "_paths")

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._paths: dict[int, Sequence[int]] = {}

    def __len__(self) -> int:
        """Requests in the tree."""
        return len(self._paths)

    def __contains__(self, h: int) -> bool:
        """Whether some waiting request's cacheable prefix holds block ``h``. O(1)."""
        return h in self._count

    @property
    def num_nodes(self) -> int:
        return len(self._count)

    def demand(self, h: int) -> int:
        """Waiting requests whose cacheable prefix holds block ``h``. O(1)."""
        return self._count.get(h, 0)

    def path(self, key: int) -> Sequence[int]:
        return self._paths[key]

    def add(self, key: int, hashes: Sequence[int]) -> None:
        """Insert request ``key`` with cacheable blocks ``hashes``. O(len(hashes))."""
        if key in self._paths:
            raise KeyError(f"request {key} is already in the tree")
        self._paths[key] = hashes
        count = self._count
        for h in hashes:
            count[h] = count.get(h, 0) + 1

    def remove(self, key: int) -> Sequence[int]:
        """Drop request ``key``; return its blocks. O(len(blocks))."""
        hashes = self._paths.pop(key)
        count = self._count
        for h in hashes:
            c = count[h] - 1
            if c:
                count[h] = c
            else:
                del count[h]
        return hashes

    def dual_walk(self, contains: Callable[[int], bool]) -> dict[int, int]:
        """Every waiting request's longest cached prefix (in blocks), by walking the tree against
        the cache: a walk stops at the first uncached block, and a node shared by many requests
        probes the cache once. O(sum of hits + nodes probed)."""
        probed: dict[int, bool] = {}
        out: dict[int, int] = {}
        for key, hashes in self._paths.items():
            i = 0
            for h in hashes:
                hit = probed.get(h)
                if hit is None:
                    hit = probed[h] = contains(h)
                if not hit:
                    break
                i += 1
            out[key] = i
        return out

    def check(self) -> None:
        """Assert the invariants (tests). O(nodes + blocks)."""
        ends: dict[int, int] = {}
        fresh: dict[int, int] = {}
        parent: dict[int, int] = {}
        for hashes in self._paths.values():
            prev = ROOT
            for h in hashes:
                fresh[h] = fresh.get(h, 0) + 1
                assert parent.setdefault(h, prev) == prev, "a block has two parents"
                prev = h
            if hashes:
                ends[hashes[-1]] = ends.get(hashes[-1], 0) + 1
        assert fresh == self._count, "counts differ from a rebuild"
        below: dict[int, int] = {}
        for h, p in parent.items():
            if p != ROOT:
                below[p] = below.get(p, 0) + self._count[h]
                assert self._count[h] <= self._count[p]
        for h, c in self._count.items():
            assert c >= 1 and c == ends.get(h, 0) + below.get(h, 0)
