"""KV block pool with a prefix cache, following vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue``.

- Blocks are ref-counted. A running request holds its blocks (ref >= 1).
- A full block computed by a request gets its chained hash and enters the prefix cache
  (``hash -> block``). If the hash is already cached by another block, the new block stays
  unhashed (vLLM keeps the first copy).
- Blocks whose ref count drops to 0 join the tail of the free queue but keep their hash: they are
  still cache hits until reused. A request frees its blocks tail-first, so its last blocks are
  evicted first (vLLM's order).
- Allocation pops the head of the free queue: the least recently freed block. If it carried a
  hash, that hash leaves the cache (eviction, LRU).
- Every store and eviction is appended to ``events`` as (True, hash) / (False, hash), the shape of
  vLLM's KV events (BlockStored / BlockRemoved); hosts drain them into the policies.

Why an OrderedDict: O(1) append, O(1) removal from the middle (a cached block touched again) and
O(1) pop of the LRU head, the same costs as vLLM's doubly linked free list.

Beyond vLLM (engine model only, off by default):

- **Retention strategies** (``retention``): which free block is evicted first. ``"lru"`` is the
  stock order above. The others rank free blocks by *demand*, which the host declares per hash
  with ``add_demand``: queue demand (the cacheable prefixes of queued requests) and session
  demand (the contexts of sessions awaiting their next turn). ``"peek"``: blocks no queued
  request needs go first, LRU among each group. ``"prism"``: fewest queued requests needing the
  block first, then LRU. ``"session"``: blocks neither a queued request nor a waiting session
  needs go first, then LRU. Why a heap: a free block's rank changes when demand does, which an
  ordered dict cannot reorder in place; a binary heap of ``(rank, free tick, block)`` with lazy
  deletion (an entry is live only if its block is still free with that tick and rank) gives
  O(log n) amortised eviction and re-ranking, and is rebuilt when stale entries pass 4x the
  free blocks.
- **Host tier** (``host_blocks`` > 0): a hash evicted from the GPU pool is kept in a host
  (CPU) LRU of that many blocks, the shape of vLLM's CPU offloading (it writes blocks through to
  host memory; the host copy matters once the GPU copy is gone). ``host_hit`` finds the host
  continuation of a GPU hit; the engine reloads those blocks instead of recomputing them.
  ``__contains__`` and the events cover both tiers: a hash leaves the cache (False event) only
  when it is in neither tier, so policies see a host hit as a hit.
- **Tier events** (host tier only): a second stream, ``tier_events``, says which hashes are
  *host-only* (in the host tier and not on the GPU): ``(True, h)`` when ``h`` becomes host-only
  (evicted from the GPU, kept in the host tier), ``(False, h)`` when it stops being host-only
  (reloaded or recomputed into the GPU, or dropped from the host tier, which also emits the
  ``(False, h)`` KV event). The stream alone replays the host-only set exactly; applied together
  with the KV events of the same flush, a router tells a GPU hit, a host hit and a miss apart
  (``PrefixIndex.on_tier_events``). Why a second stream, not a third event kind: the policies
  and every host consume ``(stored, hash)`` pairs, which stay unchanged. Without a host tier
  nothing is ever appended (the default path pays nothing). O(1) per transition.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not

_FOUND = partial(is_not, None)  # x -> x is not None, without a Python frame per probe

RETENTIONS = ("lru", "peek", "prism", "session")
QUEUE = 0  # demand kinds for ``add_demand``
SESSION = 1


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Ref-counted KV blocks with a hash-keyed prefix cache and LRU eviction of free blocks."""

    __slots__ = (
        "num_blocks", "block_size", "ref", "block_hash", "free", "cached", "events", "evictions",
        "retention", "tracking", "qdem", "sdem", "n_free_wanted", "_heap", "_ftick", "_frank",
        "_tick", "host_capacity", "host", "host_evictions", "tier_events",
    )

    def __init__(
        self, num_blocks: int, block_size: int = 16, retention: str = "lru", host_blocks: int = 0,
        track_demand: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if retention not in RETENTIONS:
            raise ValueError(f"unknown retention {retention!r}; known: {', '.join(RETENTIONS)}")
        if host_blocks < 0:
            raise ValueError("host_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.events: list[tuple[bool, int]] = []
        self.evictions = 0
        self.retention = retention
        # demand per hash (kept only when tracking): queued requests / waiting sessions needing it
        self.tracking = track_demand or retention != "lru"
        self.qdem: dict[int, int] = {}
        self.sdem: dict[int, int] = {}
        self.n_free_wanted = 0  # free blocks whose hash some queued request or waiting session needs
        # victim order for the non-LRU strategies: (rank, free tick, block), lazily deleted
        self._heap: list[tuple[int, int, int]] = []
        self._ftick = [0] * num_blocks
        self._frank = [0] * num_blocks
        self._tick = 0
        if retention != "lru":
            self._heap = [(0, 0, b) for b in range(num_blocks)]
        self.host_capacity = host_blocks
        self.host: OrderedDict[int, None] = OrderedDict()  # host-tier hashes, LRU first
        self.host_evictions = 0
        # (host_only, hash) transitions of the host-only set (module docstring, Tier events)
        self.tier_events: list[tuple[bool, int]] = []

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not). O(1)."""
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def __contains__(self, h: int) -> bool:
        return h in self.cached or h in self.host

    # -- demand and retention ----------------------------------------------------------------

    def _wanted(self, h: int) -> bool:
        return h in self.qdem or h in self.sdem

    def _rank(self, h: int | None) -> int:
        """Eviction rank of a free block holding ``h`` (lower goes first)."""
        if h is None:
            return 0
        ret = self.retention
        if ret == "prism":
            return self.qdem.get(h, 0)
        if ret == "peek":
            return 1 if h in self.qdem else 0
        return 1 if self._wanted(h) else 0  # "session" (the only other ranked order)

    def _push_free(self, b: int) -> None:
        """Index a newly free block for the non-LRU victim order. O(log n)."""
        self._tick += 1
        self._ftick[b] = self._tick
        r = self._rank(self.block_hash[b])
        self._frank[b] = r
        heapq.heappush(self._heap, (r, self._tick, b))

    def add_demand(self, hashes: Iterable[int], kind: int, delta: int) -> None:
        """Declare that one more (``delta`` = 1) or one fewer (-1) queued request (``kind`` =
        QUEUE) or waiting session (SESSION) needs each of ``hashes``. Re-ranks the free blocks
        that hold them. O(len(hashes)) dict updates plus O(log n) per re-ranked free block."""
        if not self.tracking:
            return
        dem = self.qdem if kind == QUEUE else self.sdem
        other = self.sdem if kind == QUEUE else self.qdem
        cached = self.cached
        ref = self.ref
        heap_mode = self.retention != "lru"
        for h in hashes:
            old = dem.get(h, 0)
            new = old + delta
            if new < 0:
                raise RuntimeError(f"demand for hash {h} below zero")
            if new:
                dem[h] = new
            else:
                del dem[h]
            b = cached.get(h)
            if b is None or ref[b] != 0:
                continue
            if (old == 0) != (new == 0) and h not in other:
                self.n_free_wanted += 1 if new else -1
            if heap_mode:
                r = self._rank(h)
                if r != self._frank[b]:
                    self._frank[b] = r
                    heapq.heappush(self._heap, (r, self._ftick[b], b))

    def _pop_victim(self) -> int:
        """The next free block to reuse under a ranked retention strategy (``allocate`` pops the
        LRU order itself). O(log n) amortised."""
        heap = self._heap
        ref, ftick, frank = self.ref, self._ftick, self._frank
        while True:
            r, t, b = heapq.heappop(heap)
            if ref[b] == 0 and ftick[b] == t and frank[b] == r:
                del self.free[b]
                return b

    def _compact(self) -> None:
        if self.retention != "lru" and len(self._heap) > 4 * len(self.free) + 1024:
            ftick, frank = self._ftick, self._frank
            self._heap = [(frank[b], ftick[b], b) for b in self.free]
            heapq.heapify(self._heap)

    # -- host tier ---------------------------------------------------------------------------

    def host_hit(self, hashes: Sequence[int], start: int) -> int:
        """How many of ``hashes[start:]`` continue the hit from the host tier. O(matched + 1)."""
        if not self.host:
            return 0
        host = self.host
        n = 0
        for k in range(start, len(hashes)):
            if hashes[k] not in host:
                break
            n += 1
        return n

    def host_touch(self, hashes: Iterable[int]) -> None:
        """Mark host-tier hashes as just used (before a reload, so the reload's own allocation
        cannot push them out). O(len)."""
        host = self.host
        for h in hashes:
            host.move_to_end(h)

    def _to_host(self, h: int) -> None:
        """``h`` left the GPU pool: keep it in the host LRU (now host-only), dropping the host's
        least recently used hash when over capacity. O(1)."""
        host = self.host
        host[h] = None
        host.move_to_end(h)
        self.tier_events.append((True, h))
        if len(host) > self.host_capacity:
            old, _ = host.popitem(last=False)
            self.host_evictions += 1
            if old not in self.cached:  # it was host-only: it leaves both the tier and the cache
                self.tier_events.append((False, old))
                self.events.append((False, old))

    def host_only(self) -> list[int]:
        """The hashes held in the host tier and not on the GPU (the set the tier events replay);
        [] without a host tier. O(host-tier hashes)."""
        cached = self.cached
        return [h for h in self.host if h not in cached]

    def longest_hit(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``. O(matched + 1) probes, run
        by ``map``/``takewhile`` (no interpreted loop: this is on every arrival and admission)."""
        return list(takewhile(_FOUND, map(self.cached.get, hashes)))

    def blocks_of(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of ``hashes``, all cached (a hit whose length is known). O(len), one ``map``."""
        return list(map(self.cached.__getitem__, hashes))

    def free_cached(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` are cached in free blocks (held by no running request, so the
        next allocations may evict them). O(len(hashes))."""
        cached, ref = self.cached, self.ref
        return sum(1 for h in hashes if (b := cached.get(h)) is not None and ref[b] == 0)

    def free_after_touch(self, blocks: Sequence[int]) -> int:
        """Free blocks left if ``blocks`` (cache hits) were touched. O(len(blocks))."""
        return len(self.free) - list(map(self.ref.__getitem__, blocks)).count(0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        track = self.tracking
        ref, free = self.ref, self.free
        for b in blocks:
            r = ref[b]
            if r == 0:
                del free[b]
                if track:
                    h = self.block_hash[b]
                    if h is not None and self._wanted(h):
                        self.n_free_wanted -= 1
            ref[b] = r + 1

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks in the retention order (LRU head for ``"lru"``), evicting their
        hashes (to the host tier when there is one). O(n), O(n log n) for the ranked orders."""
        if n > len(self.free):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free)} free")
        out: list[int] = []
        track = self.tracking
        host = self.host_capacity > 0
        lru = self.retention == "lru"
        free, block_hash, cached, ref = self.free, self.block_hash, self.cached, self.ref
        if lru and not track and not host:  # the default engine: the same steps, in one loop
            out = list(islice(free, n))  # the LRU head's n blocks (popped below, in order)
            ev = self.events.append
            evicted = 0
            for b in out:
                del free[b]
                h = block_hash[b]
                if h is not None:
                    del cached[h]
                    ev((False, h))
                    block_hash[b] = None
                    evicted += 1
                ref[b] = 1
            self.evictions += evicted
            return out
        for _ in range(n):
            b = free.popitem(last=False)[0] if lru else self._pop_victim()
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                del cached[h]
                self.evictions += 1
                if track and self._wanted(h):
                    self.n_free_wanted -= 1
                if host:
                    self._to_host(h)
                else:
                    self.events.append((False, h))
            ref[b] = 1
            out.append(b)
        return out

    def cache_block(self, b: int, h: int) -> None:
        """Register a newly full block under its chained hash (first copy wins)."""
        if self.block_hash[b] is not None or h in self.cached:
            return
        self.block_hash[b] = h
        self.cached[h] = b
        if h not in self.host:
            self.events.append((True, h))
        else:  # it was host-only (reloaded, or recomputed): a GPU hit again
            self.tier_events.append((False, h))
        if self.ref[b] == 0:  # not the engine's use; kept consistent for direct callers
            if self.tracking and self._wanted(h):
                self.n_free_wanted += 1
            if self.retention != "lru":
                self._push_free(b)

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """``cache_block(blocks[k], hashes[k])`` for every k, in order: the blocks a step
        filled. O(len(blocks))."""
        block_hash, cached = self.block_hash, self.cached
        if self.host or self.tracking or self.retention != "lru":
            for b, h in zip(blocks, hashes, strict=True):
                self.cache_block(b, h)
            return
        ev = self.events.append
        for b, h in zip(blocks, hashes, strict=True):  # cache_block with no host tier, LRU, no demand
            if block_hash[b] is not None or h in cached:
                continue
            block_hash[b] = h
            cached[h] = b
            ev((True, h))

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a request's references, tail block first, so its tail is evicted first.
        O(len(blocks)); the default pool's usual case (no block shared with another request)
        appends them to the free queue after one check of their counts."""
        track = self.tracking
        heap_mode = self.retention != "lru"
        ref, free = self.ref, self.free
        if not track and not heap_mode:
            rev = blocks[::-1]
            if list(map(ref.__getitem__, rev)).count(1) == len(rev):
                n_free = len(free)
                for b in rev:
                    free[b] = None
                    ref[b] = 0
                if len(free) - n_free != len(rev):
                    raise RuntimeError("a block released twice")
                return
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                free[b] = None
                if track:
                    h = self.block_hash[b]
                    if h is not None and self._wanted(h):
                        self.n_free_wanted += 1
                if heap_mode:
                    self._push_free(b)
            elif r < 0:
                ref[b] = 0
                raise RuntimeError(f"block {b} released twice")
        if heap_mode:
            self._compact()

    def drain_events(self) -> list[tuple[bool, int]]:
        ev = self.events
        self.events = []
        return ev

    def drain_tier_events(self) -> list[tuple[bool, int]]:
        """The tier events since the last drain (always empty without a host tier). O(1)."""
        ev = self.tier_events
        self.tier_events = []
        return ev
