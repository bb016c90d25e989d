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

Complexity: O(B log B) for B blocks referenced in the sequence, vectorised: the references are
flattened once into dense integer ids (``References``: one numpy argsort), the infinite-cache hits
and the LRU replay are array passes, and MIN runs its heap loop only when the reused blocks do
not all fit at once (a sweep over the blocks' live intervals decides that in O(B)).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from fairway.request import RequestSpec


@dataclass(frozen=True, slots=True)
class References:
    """Every block a request sequence references, in arrival order (requests sorted by
    ``(arrival_s, rid)``, each request's blocks in order), as dense integer ids.

    ``ids[i]``: the block of reference i (equal ids, equal hashes); ``first[i]``: reference i is
    its block's first; ``count[x]``: references to block id x; ``starts``/``lens``: each request's
    slice of ``ids``; ``cacheable``: each request's reusable prompt blocks (all full blocks but
    the one holding its last token); ``counted[i]``: reference i is one of those;
    ``prompts``: each request's prompt tokens; ``prompt_tokens``: the sequence's. Built in
    O(B log B) (one sort of the hashes).
    """

    ids: np.ndarray
    first: np.ndarray
    count: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    cacheable: np.ndarray
    counted: np.ndarray
    prompts: np.ndarray
    prompt_tokens: int

    @classmethod
    def of(cls, specs: Sequence[RequestSpec], block_size: int) -> References:
        order = sorted(specs, key=lambda x: (x.arrival_s, x.rid))
        n = len(order)
        lens = np.fromiter((len(s.block_hashes) for s in order), np.int64, n)
        total = int(lens.sum())
        try:  # engine hashes are 64-bit unsigned: one vectorised sort
            flat = np.fromiter(chain.from_iterable(s.block_hashes for s in order), np.uint64, total)
        except OverflowError:  # any other ints (hand-made hashes in tests): numbered by first appearance
            seen: dict[int, int] = {}
            flat = np.fromiter((seen.setdefault(h, len(seen)) for s in order for h in s.block_hashes), np.int64, total)
        first_idx, ids, count = _dense_ids(flat)
        first = np.zeros(total, dtype=bool)
        first[first_idx] = True
        starts = np.cumsum(lens) - lens
        prompts = np.fromiter((s.prompt_tokens for s in order), np.int64, n)
        cacheable = np.maximum(0, (prompts - 1) // block_size)
        counted = (np.arange(total) - np.repeat(starts, lens)) < np.repeat(cacheable, lens)
        return cls(ids, first, count, starts, lens, cacheable, counted, prompts, int(prompts.sum()))


def _dense_ids(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(flat, return_index=True, return_inverse=True, return_counts=True)`` without
    the values: (each distinct value's first index, each element's rank among the distinct
    values, each distinct value's count), the same arrays. Why not ``np.unique``: it sorts
    stably to find first indices; an unstable argsort plus a minimum per run of equal values
    gives the same first indices with fewer and cheaper passes, which matter on a long trace
    (9M references: about half the time). O(B log B)."""
    if not len(flat):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    o = np.argsort(flat)
    s = flat[o]
    new = np.empty(len(s), dtype=bool)  # s[k] starts a run of equal values
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    del s
    starts = np.flatnonzero(new)
    ids = np.empty(len(o), dtype=np.int64)
    ids[o] = np.cumsum(new) - 1
    return np.minimum.reduceat(o, starts), ids, np.diff(starts, append=len(o))


def _infinite_hits(refs: References) -> int:
    """Reusable prompt blocks that an earlier reference brought in. O(B)."""
    return int(np.count_nonzero(refs.counted & ~refs.first))


def _stable_order(r: np.ndarray) -> np.ndarray:
    """``np.argsort(r, kind="stable")`` for non-negative ids: one sort of (id, index) packed
    in 64 bits, whose keys are distinct, so any sort gives the stable order, and numpy's
    default sort of integers is several times faster than its stable one (7x on 10M ids
    here). Falls back to the stable argsort where ids or indices need more than 32 bits. O(B log B)."""
    m = len(r)
    if not m or m >= 1 << 32 or int(r.min()) < 0 or int(r.max()) >= 1 << 32:
        return np.argsort(r, kind="stable")
    key = (r.astype(np.uint64) << np.uint64(32)) | np.arange(m, dtype=np.uint64)
    key.sort()
    return (key & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _next_use(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index of the next reference to the same block, len(r) if none; each block's first and
    last reference index). O(B log B)."""
    m = len(r)
    o = _stable_order(r)
    s = r[o]
    same = s[1:] == s[:-1]
    nxt = np.full(m, m, dtype=np.int64)
    nxt[o[:-1][same]] = o[1:][same]
    starts = np.concatenate(([True], ~same))
    ends = np.concatenate((~same, [True]))
    return nxt, o[starts], o[ends]


def _min_hits(r: np.ndarray, capacity_blocks: int) -> int:
    """Hits of Belady's MIN over the block ids ``r`` with ``capacity_blocks``.

    If at every first reference the blocks between their first and last reference (those MIN
    would keep), plus the referenced block when it is never used again, number at most
    ``capacity_blocks``, every eviction MIN makes is of a block never used again, so it hits
    every repeat: an O(B) sweep decides that and the heap replay is skipped. Otherwise the
    replay: a max-heap on next use with stale entries skipped on pop.
    O(B log B)."""
    m = len(r)
    if not m:
        return 0
    nxt, first, last = _next_use(r)
    # blocks needed later (first <= i < last), plus one slot for a block referenced only once
    live = np.cumsum(np.bincount(first, minlength=m + 1) - np.bincount(last, minlength=m + 1))[:m]
    if int((live[first] + (nxt[first] == m)).max()) <= capacity_blocks:
        return m - len(first)
    nu = nxt.tolist()
    cur = [-1] * (int(r.max()) + 1)  # block id -> its next use while cached, else -1
    size = 0
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped on pop
    hits = 0
    for i, x in enumerate(r.tolist()):
        if cur[x] >= 0:
            hits += 1
        else:
            if size >= capacity_blocks:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cur[victim] == -neg:
                        cur[victim] = -1
                        size -= 1
                        break
            size += 1
        cur[x] = nu[i]
        heapq.heappush(heap, (-nu[i], x))
    return hits


def hit_ratio_bounds(specs: Sequence[RequestSpec], capacity_blocks: int, block_size: int,
                     refs: References | None = None) -> tuple[float, float]:
    """(the bound at ``capacity_blocks``, the no-eviction bound), from one pass over the
    references (``refs``: ``References.of(specs, block_size)`` if already built). O(B log B)."""
    if capacity_blocks < 1:
        raise ValueError("capacity_blocks must be >= 1")
    if refs is None:
        refs = References.of(specs, block_size)
    prompt = refs.prompt_tokens
    if not prompt:
        return 0.0, 0.0
    infinite = _infinite_hits(refs)
    # A block referenced once never hits, and MIN evicts it before any other (it is never used
    # again): it changes no hit, so the replay leaves it out. If the reused blocks all fit,
    # nothing that matters is ever evicted and MIN hits every repeat.
    reused_block = refs.count > 1
    fits = int(np.count_nonzero(reused_block)) <= capacity_blocks
    if fits:
        at_capacity = infinite
    else:
        at_capacity = min(_min_hits(refs.ids[reused_block[refs.ids]], capacity_blocks), infinite)
    return at_capacity * block_size / prompt, infinite * block_size / prompt


def infinite_cache_hit_ratio(specs: Sequence[RequestSpec], block_size: int) -> float:
    """Cached tokens / prompt tokens with a cache that never evicts. O(B log B)."""
    refs = References.of(specs, block_size)
    return _infinite_hits(refs) * block_size / refs.prompt_tokens if refs.prompt_tokens else 0.0


def optimal_eviction_hit_ratio(specs: Sequence[RequestSpec], capacity_blocks: int, block_size: int) -> float:
    """A bound on cached tokens / prompt tokens for ``capacity_blocks`` in all: Belady's MIN
    over every referenced block, capped by the infinite cache. O(B log B)."""
    return hit_ratio_bounds(specs, capacity_blocks, block_size)[0]
