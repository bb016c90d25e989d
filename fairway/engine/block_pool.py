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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Ref-counted KV blocks with a hash-keyed prefix cache and LRU eviction of free blocks."""

    __slots__ = ("num_blocks", "block_size", "ref", "block_hash", "free", "cached", "events", "evictions")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.events: list[tuple[bool, int]] = []
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not). O(1)."""
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def __contains__(self, h: int) -> bool:
        return h in self.cached

    def longest_hit(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``. O(matched + 1)."""
        out: list[int] = []
        cached = self.cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def free_after_touch(self, blocks: Sequence[int]) -> int:
        """Free blocks left if ``blocks`` (cache hits) were touched. O(len(blocks))."""
        return len(self.free) - sum(1 for b in blocks if self.ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the LRU head, evicting their hashes. O(n)."""
        if n > len(self.free):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                del self.cached[h]
                self.evictions += 1
                self.events.append((False, h))
            self.ref[b] = 1
            out.append(b)
        return out

    def cache_block(self, b: int, h: int) -> None:
        """Register a newly full block under its chained hash (first copy wins)."""
        if self.block_hash[b] is not None or h in self.cached:
            return
        self.block_hash[b] = h
        self.cached[h] = b
        self.events.append((True, h))

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a request's references, tail block first, so its tail is evicted first."""
        for b in reversed(blocks):
            r = self.ref[b] - 1
            self.ref[b] = r
            if r == 0:
                self.free[b] = None
            elif r < 0:
                raise RuntimeError(f"block {b} released twice")

    def drain_events(self) -> list[tuple[bool, int]]:
        ev = self.events
        self.events = []
        return ev
