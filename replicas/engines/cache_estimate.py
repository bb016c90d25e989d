"""An engine's prefix cache estimated in our hash space, for engines whose own block hashes we
cannot read (vLLM: its block hashes differ from ``fairway/hashing.py``'s).

Why: the gate's ``can_fit`` / ``cached_prefix_blocks`` and the routers' prefix index need the
replica's cached blocks *as our hashes*. The vLLM adapter cannot list vLLM's cache, but it knows
every prompt it served and the ``num_cached_tokens`` vLLM reported for each. So it keeps:

- an LRU of the block hashes (ours, ``block_size`` tokens each) of the prompts it served, bounded
  by the engine's KV capacity expressed in our blocks;
- only what the engine actually caches: whole *engine* blocks (``engine_block_size`` tokens; 128
  on vLLM-CPU, 16 on GPU) of each prompt, so a 300-token prompt stores 256 tokens = 16 of our
  blocks, not 18;
- the same eviction order as vLLM's free-block queue: a request's blocks are touched tail first
  (its head ends most recent), so a chain's tail ages out before its head, and every block's
  parent (the block before it in its chain) is more recent than the block. The estimate is
  therefore prefix-closed: a block is held only with all its ancestors, and the least recently
  touched block is always a leaf;
- a correction from each report: when the engine's hit stops at block ``hit`` but the estimate
  held the chain further, block ``hit`` had been evicted by the engine, and with it (tail-first
  eviction) everything hanging below it. The blocks past the reported hit are dropped -- the
  whole subtree under block ``hit`` -- except this request's own blocks, which its prefill just
  stored again.

Every change is reported to a listener as stored / removed hash batches (the events the routers'
prefix index consumes in events mode). Plain Python, no vLLM import, so it is unit-tested alone.

Limits: blocks pinned by running requests cannot be evicted in the engine but can age out here;
the engine's reordering at request *finish* is approximated by ``touch`` (call it then).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fairway.hashing import longest_cached_prefix

Listener = Callable[[Iterable[int]], None]


@dataclass(slots=True)
class CacheUpdate:
    """What one ``observe`` changed: hashes newly stored, hashes removed (dropped as stale or aged
    out), and how many blocks the estimate had predicted as a hit for the request."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    predicted_blocks: int = 0
    reported_blocks: int | None = None


class CacheEstimate:
    """LRU estimate of an engine's prefix cache in ``fairway/hashing.py`` block hashes.

    Invariants: ``len(self) <= capacity_blocks`` after every call; prefix-closed (a held block's
    parent is held and more recently touched). Costs: lookups O(matched + 1); ``observe`` /
    ``touch`` O(prompt blocks + blocks removed).
    """

    __slots__ = ("_lru", "_children", "_cap", "block_size", "engine_block_size", "_on_stored", "_on_removed")

    def __init__(self, capacity_blocks: int, block_size: int = 16, engine_block_size: int | None = None) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be >= 1")
        ebs = block_size if engine_block_size is None else engine_block_size
        if ebs < 1:
            raise ValueError("engine_block_size must be >= 1")
        self._lru: OrderedDict[int, int | None] = OrderedDict()  # hash -> parent hash; oldest first
        self._children: dict[int, set[int]] = {}
        self._cap = capacity_blocks
        self.block_size = block_size
        self.engine_block_size = ebs
        self._on_stored: Listener | None = None
        self._on_removed: Listener | None = None

    # -- shape / reads -----------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return self._cap

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Change the bound (the engine's real KV size became known); returns the hashes aged out."""
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self._cap = capacity_blocks
        removed = self._age()
        self._emit([], removed)
        return removed

    def set_listener(self, on_stored: Listener | None, on_removed: Listener | None) -> None:
        self._on_stored, self._on_removed = on_stored, on_removed

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def blocks(self) -> list[int]:
        """Held hashes, least recently touched first (the eviction order)."""
        return list(self._lru)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` held; stops at the first miss. Read-only. O(matched + 1)."""
        return longest_cached_prefix(hashes, self._lru)

    def stored_blocks(self, prompt_tokens: int) -> int:
        """Our blocks of a prompt that the engine keeps after prefill: its whole engine blocks."""
        ebs = self.engine_block_size
        return (prompt_tokens // ebs) * ebs // self.block_size

    def max_hit_blocks(self, prompt_tokens: int) -> int:
        """The longest hit the engine can report, in our blocks: whole engine blocks of all but
        the last prompt token (the last token is always computed)."""
        ebs = self.engine_block_size
        return (max(0, prompt_tokens - 1) // ebs) * ebs // self.block_size

    def predicted_hit_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """The hit the estimate predicts the engine will report, in our blocks."""
        return min(self.cached_prefix_blocks(hashes), self.max_hit_blocks(prompt_tokens))

    # -- updates -----------------------------------------------------------------------------

    def observe(self, hashes: Sequence[int], prompt_tokens: int, cached_tokens: int | None) -> CacheUpdate:
        """A request with prompt blocks ``hashes`` (``prompt_tokens`` tokens) was prefilled and the
        engine reported ``cached_tokens`` (None: unknown) from its cache.

        Drops the stale blocks past the reported hit (see the module doc), stores the request's
        whole engine blocks tail first, ages the estimate to capacity, and emits the net change.
        """
        upd = CacheUpdate(predicted_blocks=self.predicted_hit_blocks(hashes, prompt_tokens))
        chain = list(hashes[: min(len(hashes), self.stored_blocks(prompt_tokens))])
        dropped: list[int] = []
        if cached_tokens is not None:
            if cached_tokens < 0:
                raise ValueError("cached_tokens must be >= 0")
            hit = min(cached_tokens // self.block_size, len(hashes))
            upd.reported_blocks = hit
            if upd.predicted_blocks > hit:
                dropped = self._drop_subtree(hashes[hit], keep=set(chain))
        new = self._insert(chain)
        aged = self._age()
        gone = set(dropped) | set(aged)
        new_set = set(new)
        upd.stored = [h for h in new if h not in gone]
        upd.removed = [h for h in dropped + aged if h not in new_set]
        self._emit(upd.stored, upd.removed)
        return upd

    def touch(self, hashes: Sequence[int]) -> None:
        """Refresh the held prefix of ``hashes``, tail first (a request finished and the engine
        freed its blocks to the back of its eviction queue). Stores nothing new. O(prefix)."""
        n = self.cached_prefix_blocks(hashes)
        for h in reversed(hashes[:n]):
            self._lru.move_to_end(h)

    def clear(self) -> list[int]:
        """Forget everything (the engine reset its prefix cache); returns and emits the removed."""
        removed = list(self._lru)
        self._lru.clear()
        self._children.clear()
        self._emit([], removed)
        return removed

    # -- internals ---------------------------------------------------------------------------

    def _emit(self, stored: list[int], removed: list[int]) -> None:
        if removed and self._on_removed is not None:
            self._on_removed(removed)
        if stored and self._on_stored is not None:
            self._on_stored(stored)

    def _insert(self, chain: Sequence[int]) -> list[int]:
        """Mark ``chain`` held, tail first; returns the hashes that were not held (chain order)."""
        lru, children = self._lru, self._children
        new: list[int] = []
        for i in range(len(chain) - 1, -1, -1):
            h = chain[i]
            if h in lru:
                lru.move_to_end(h)
                continue
            parent = chain[i - 1] if i else None
            lru[h] = parent
            if parent is not None:
                children.setdefault(parent, set()).add(h)
            new.append(h)
        new.reverse()
        return new

    def _unlink(self, h: int) -> None:
        parent = self._lru.pop(h)
        self._children.pop(h, None)
        if parent is not None:
            sibs = self._children.get(parent)
            if sibs is not None:
                sibs.discard(h)
                if not sibs:
                    del self._children[parent]

    def _drop_subtree(self, root: int, keep: set[int]) -> list[int]:
        """Remove the held blocks under ``root`` (``root`` included) except those in ``keep``
        (a kept block's kept descendants stay too: ``keep`` is one chain). Returns the removed."""
        if root not in self._lru:
            return []
        removed: list[int] = []
        stack = [root]
        while stack:
            h = stack.pop()
            kids = list(self._children.get(h, ()))
            if h in keep:
                stack.extend(kids)
                continue
            # remove h and its whole subtree, leaves first
            sub, order = [h], []
            while sub:
                x = sub.pop()
                order.append(x)
                sub.extend(self._children.get(x, ()))
            for x in reversed(order):
                self._unlink(x)
                removed.append(x)
        return removed

    def _age(self) -> list[int]:
        """Drop the least recently touched blocks while over capacity (each a leaf, by the
        prefix-closed invariant; a non-leaf would take its subtree with it)."""
        removed: list[int] = []
        lru = self._lru
        while len(lru) > self._cap:
            h = next(iter(lru))
            if self._children.get(h):
                removed.extend(self._drop_subtree(h, keep=set()))
            else:
                self._unlink(h)
                removed.append(h)
        return removed


__all__ = ["CacheEstimate", "CacheUpdate"]
