"""Upper bounds on the prefix-cache hit ratio any routing can reach on a request sequence.

The LRU replay (``sim/cluster.py: ceiling_hit_ratio``: one shared LRU cache of the cluster's
capacity, requests in arrival order) is a reference, not a bound: LRU is not the best eviction
for a given capacity, and a router spreading requests over replicas can beat it (consistent
hashing does on a Mooncake trace). Two true bounds, over the prompt blocks a request can reuse
(all of its full blocks but one that holds its last token, as an engine recomputes that one):

- ``infinite_cache_hit_ratio``: nothing is ever evicted, so a block hits iff an earlier request
  had it. Chained hashes name their whole prefix, so this equals the prefix-walk hit.
- ``optimal_eviction_hit_ratio``: Belady's MIN (evict the block used again farthest in the
  future) on one cache of the cluster's total capacity, over every block each request references
  (its prompt and output blocks, as an engine caches both), capped by the infinite-cache bound.
  Why it bounds every cluster: the union of R replica caches is one cache of that capacity, in
  which every block a replica holds is held; a hit on a replica is a hit of that union; counting
  block hits rather than prefix walks, and hits on blocks that are not reusable prompt blocks,
  only adds hits; and MIN maximises hits for a fixed capacity among all eviction orders. Blocks
  held by running requests cannot be evicted in a real engine, which only lowers what it reaches.

Complexity: O(B) and O(B log B) for B blocks referenced in the sequence.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence

from fairway.request import RequestSpec


def _references(specs: Sequence[RequestSpec], block_size: int) -> tuple[list[int], list[bool], int]:
    """Every block the requests reference in arrival order, whether each is a reusable prompt
    block (counted), and the sequence's prompt tokens."""
    refs: list[int] = []
    counted: list[bool] = []
    prompt = 0
    for s in sorted(specs, key=lambda x: (x.arrival_s, x.rid)):
        n = max(0, (s.prompt_tokens - 1) // block_size)
        refs.extend(s.block_hashes)
        counted.extend(i < n for i in range(len(s.block_hashes)))
        prompt += s.prompt_tokens
    return refs, counted, prompt


def _infinite_hits(refs: list[int], counted: list[bool]) -> int:
    seen: set[int] = set()
    hits = 0
    for h, c in zip(refs, counted, strict=True):
        if h in seen:
            hits += c
        else:
            seen.add(h)
    return hits


def _min_hits(refs: list[int], capacity_blocks: int) -> int:
    """Hits of Belady's MIN over ``refs`` with ``capacity_blocks``. O(B log B)."""
    n = len(refs)
    next_use = [n] * n  # index of the next reference to the same block (n: never)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(refs[i], n)
        last[refs[i]] = i
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped on pop
    hits = 0
    for i, h in enumerate(refs):
        if h in cache:
            hits += 1
        elif len(cache) >= capacity_blocks:
            while True:
                nu, victim = heapq.heappop(heap)
                if cache.get(victim) == -nu:
                    del cache[victim]
                    break
        cache[h] = next_use[i]
        heapq.heappush(heap, (-next_use[i], h))
    return hits


def hit_ratio_bounds(specs: Sequence[RequestSpec], capacity_blocks: int, block_size: int) -> tuple[float, float]:
    """(the bound at ``capacity_blocks``, the no-eviction bound), from one pass over the
    references. O(B), or O(B log B) when the reused blocks do not fit."""
    if capacity_blocks < 1:
        raise ValueError("capacity_blocks must be >= 1")
    refs, counted, prompt = _references(specs, block_size)
    if not prompt:
        return 0.0, 0.0
    infinite = _infinite_hits(refs, counted)
    # A block referenced once never hits, and MIN evicts it before any other (it is never used
    # again): it changes no hit, so the replay leaves it out. If the reused blocks all fit,
    # nothing that matters is ever evicted and MIN hits every repeat.
    counts = Counter(refs)
    reused = [h for h in refs if counts[h] > 1]
    fits = len(counts) - sum(1 for c in counts.values() if c == 1) <= capacity_blocks
    at_capacity = infinite if fits else min(_min_hits(reused, capacity_blocks), infinite)
    return at_capacity * block_size / prompt, infinite * block_size / prompt


def infinite_cache_hit_ratio(specs: Sequence[RequestSpec], block_size: int) -> float:
    """Cached tokens / prompt tokens with a cache that never evicts. O(B)."""
    refs, counted, prompt = _references(specs, block_size)
    return _infinite_hits(refs, counted) * block_size / prompt if prompt else 0.0


def optimal_eviction_hit_ratio(specs: Sequence[RequestSpec], capacity_blocks: int, block_size: int) -> float:
    """A bound on cached tokens / prompt tokens for ``capacity_blocks`` in all: Belady's MIN
    over every referenced block, capped by the infinite cache. O(B log B)."""
    return hit_ratio_bounds(specs, capacity_blocks, block_size)[0]
