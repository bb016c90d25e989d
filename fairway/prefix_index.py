"""Per-replica estimate of which KV blocks each engine replica holds: the router's prefix index.

Why: a cache-aware router needs, for every candidate replica j, the estimated cached prefix
c_rj of the request it is placing (docs/design.md, Fairway router). Keys are the engine's
own chained block hashes (``fairway/hashing.py``), so equal hashes mean equal prefixes, and the
longest cached prefix on a replica is a walk of dict probes that stops at its first miss
(docs/design.md, Block hashes in token units). Ray and SGLang match characters; we match blocks
of tokens.

Two modes:

- ``"approx"``: built from the router's own decisions. ``record_routed`` inserts a routed
  request's prompt blocks for its replica; each replica has a capacity in blocks with LRU aging
  (the oldest-touched blocks are dropped first); ``on_feedback`` corrects the estimate with the
  cached-token count the engine reports. This is what Ray's ``PrefixCacheAffinityRouter``,
  SGLang's router and AIBrix do (with characters or hashes of characters). With
  ``pin_in_flight``, the index models the engine's two kinds of block instead of one LRU over
  both: a prompt routed and not yet reported is held (pinned) where it was sent, as an engine
  keeps a running request's blocks whatever else it needs, and only finished prompts age, in a
  free pool of the capacity less the blocks in flight. An engine whose memory is nearly all
  held by running requests evicts a finished prompt within a few admissions; one LRU over both
  kept it for as long as the capacity lasted and over-promised it to the next turn.
- ``"events"``: exact. ``on_kv_events`` applies the engine's (stored, hash) events (the shape
  ``fairway.engine.block_pool.BlockPool`` and vLLM's KV events emit), so each replica's set equals its
  engine's prefix cache. On top of it, the prompts routed and not yet finished count as held
  where they were sent (``record_routed`` adds them, ``release`` or ``on_feedback`` removes
  them): without that overlay, a burst of one prompt family spreads over the replicas, since none
  of its blocks are computed yet when its siblings are placed.

Layout, and why lookups cost O(prompt blocks), not O(replicas x blocks):

- ``_where``: one dict, hash -> bitmask of the replicas holding it. A lookup probes it once per
  prompt block and ANDs the mask of replicas still matching; a replica leaves the walk at its
  first miss, and the walk ends when no replica is left.
- ``_lru[j]``: an ``OrderedDict`` per replica (oldest first) for O(1) touch, insert and
  eviction of the least recently touched block, the same costs as vLLM's free block queue.
- ``_hwhere`` (events mode, engines with a host KV tier): hash -> bitmask of the replicas where
  it is *host-only* (in the engine's host tier, not on its GPU), fed by the engines' tier events
  (``on_tier_events``). ``match_tiers`` walks it alongside ``_where`` in the same single pass,
  so a lookup tells a GPU hit (the matched prefix up to the first host-only block), a host hit
  (the rest of the match: it costs a reload, not a recompute) and a miss, still in O(prompt
  blocks + replicas). Empty without a host tier, and then ``match_tiers`` is ``match``. In
  approx mode there is no tier information: every match counts as a GPU hit.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, KeysView, Mapping, Sequence
from itertools import filterfalse, groupby, islice, repeat
from operator import itemgetter

from fairway.hashing import longest_cached_prefix

APPROX = "approx"
EVENTS = "events"
MODES = (APPROX, EVENTS)


def prefix_walk(where: Mapping[int, int], alive: int, hashes: Sequence[int], n: int) -> list[int]:
    """For each of ``n`` replicas (index = id), how many leading ``hashes`` it holds, where
    ``where`` maps a hash to the bitmask of the replicas holding it and ``alive`` is the mask of
    the replicas to walk (the others get 0). Each replica leaves the walk at its first miss, and
    the walk stops once none is left: O(matched blocks + 1) dict probes plus O(n), never
    O(n x blocks). Shared by the prefix index and the load view's active blocks."""
    out = [0] * n
    if not alive:
        return out
    i = 0
    for h in hashes:
        m = where.get(h, 0) & alive
        if m != alive:
            _scatter(out, alive & ~m, i)  # each replica leaves the walk once: O(n) in total
            alive = m
            if not alive:
                return out
        i += 1
    _scatter(out, alive, i)
    return out


def _scatter(out: list[int], mask: int, value: int) -> None:
    """``out[j] = value`` for every bit j set in ``mask``. O(bits set)."""
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = value
        mask ^= low


class PrefixIndex:
    """For each replica, an estimate of the block hashes it holds.

    Invariants (checked in tests): a hash is a key of ``_where`` iff at least one replica holds
    it; bit j of ``_where[h]`` is set iff ``h`` is in ``_lru[j]`` or (events mode, or approx with
    ``pin_in_flight``) in flight to j (``_fly[j][h] > 0``); in approx mode,
    ``len(_lru[j]) <= capacity[j]`` after every call (when a capacity is set), and with
    ``pin_in_flight`` ``len(_lru[j]) <= max(0, capacity[j] - len(_fly[j]))``.

    Replica ids are 0..num_replicas-1 and stable; ``add_replica`` appends one and
    ``clear_replica`` empties one (a replica that died, or vLLM's "all blocks cleared" event).
    """

    __slots__ = ("_mode", "_where", "_lru", "_cap", "_max_cap", "_all", "_fly", "_hwhere", "_host", "_pin")

    def __init__(
        self,
        num_replicas: int,
        mode: str = APPROX,
        capacity_blocks: int | Sequence[int | None] | None = None,
        pin_in_flight: bool = False,
    ) -> None:
        """``capacity_blocks``: per-replica capacity of the approx index in blocks (one value
        for all, one per replica, or None for unbounded). Ignored in events mode, where the
        engine's own evictions age the index. ``pin_in_flight`` (approx mode): prompts in flight
        are held until reported, and only finished ones age (the module docstring).
        O(num_replicas)."""
        if mode not in MODES:
            raise ValueError(f"unknown prefix index mode {mode!r}; known: {', '.join(MODES)}")
        if num_replicas < 0:
            raise ValueError("num_replicas must be >= 0")
        self._mode = mode
        self._pin = pin_in_flight and mode == APPROX
        self._where: dict[int, int] = {}
        self._lru: list[OrderedDict[int, None]] = []
        self._cap: list[int | None] = []
        self._max_cap: list[int | None] = []
        self._all = 0
        # events mode, per replica: hash -> prompts routed there with it, unfinished (one dict per
        # replica: no (replica, hash) tuple to build and hash per block of every routed prompt)
        self._fly: list[dict[int, int]] = []
        # events mode, host tiers: hash -> bitmask of the replicas where it is host-only, and
        # per replica its host-only hashes (for clear_replica and tests)
        self._hwhere: dict[int, int] = {}
        self._host: list[set[int]] = []
        if capacity_blocks is None or isinstance(capacity_blocks, int):
            caps: list[int | None] = [capacity_blocks] * num_replicas
        else:
            caps = list(capacity_blocks)
            if len(caps) != num_replicas:
                raise ValueError(f"{len(caps)} capacities for {num_replicas} replicas")
        for c in caps:
            self.add_replica(c)

    # -- shape -------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"approx"`` or ``"events"``."""
        return self._mode

    @property
    def num_replicas(self) -> int:
        return len(self._lru)

    def add_replica(self, capacity_blocks: int | None = None) -> int:
        """Append an empty replica (Ray's ``update_replicas`` grew the set); return its id. O(1)."""
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1 or None")
        j = len(self._lru)
        self._lru.append(OrderedDict())
        self._fly.append({})
        self._host.append(set())
        self._cap.append(capacity_blocks)
        self._max_cap.append(capacity_blocks)
        self._all |= 1 << j
        return j

    def clear_replica(self, replica: int) -> None:
        """Forget everything replica ``replica`` holds (it died or cleared its cache).

        O(blocks it held and blocks in flight to it)."""
        lru, fly = self._lru[replica], self._fly[replica]
        for h in lru:
            self._unset(replica, h)
        for h in filterfalse(lru.__contains__, fly):  # a block both held and in flight: unset once
            self._unset(replica, h)
        lru.clear()
        fly.clear()
        self._clear_host(replica)

    # -- reads -------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Longest cached prefix, in blocks, of ``hashes`` on every replica (index = replica id).

        Why: the per-replica ĉ_rj the router policies compare (docs/design.md, Notation). Each
        replica stops at its first miss; the walk stops as soon as no replica still matches.
        Read-only: a lookup does not refresh LRU ages (the block is touched when the request is
        routed there, see ``record_routed``, so the ages follow the requests each engine
        actually serves).

        Complexity: O(matched blocks + 1) dict probes plus O(num_replicas) to write the result;
        never O(replicas x blocks).
        """
        return prefix_walk(self._where, self._all, hashes, len(self._lru))

    def match_tiers(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """``match`` split by tier: ``(matched, host)`` per replica, where ``matched[j]`` is
        ``match(hashes)[j]`` (both tiers) and ``host[j]`` how many of those blocks lie at or
        after the first host-only block of the match on j. So ``matched[j] - host[j]`` blocks
        are GPU hits, ``host[j]`` host hits (priced as a reload), the rest of the prompt a miss.
        The engine reloads the run of host-tier blocks after its GPU hit; a block only on the
        GPU after a host-only one ends that run (the engine recomputes from there), which the
        index does not model: such a match is an overestimate (docs/cost-model.md).

        Why one pass: a per-replica walk of the host set would cost O(replicas x blocks); here
        each block probes ``_where`` and, while some replica is still on a GPU-only prefix,
        ``_hwhere``, and each replica leaves each walk once. Without host-only hashes it is
        ``match`` plus a list of zeros. A block routed in flight to j that is host-only there
        still counts as host (the reload may not have happened yet).

        Complexity: O(matched blocks + 1) dict probes plus O(num_replicas).
        """
        hwhere = self._hwhere
        if not hwhere:
            return self.match(hashes), [0] * len(self._lru)
        n = len(self._lru)
        out = [0] * n
        first_host = [-1] * n  # block index of the first host-only block matched on j
        alive = self._all
        gpu = alive  # replicas still matching with no host-only block yet
        where = self._where
        i = 0
        for h in hashes:
            m = where.get(h, 0) & alive
            if m != alive:
                _scatter(out, alive & ~m, i)
                alive = m
                gpu &= m
                if not alive:
                    break
            if gpu:
                hm = hwhere.get(h, 0) & gpu
                if hm:
                    gpu ^= hm
                    _scatter(first_host, hm, i)
            i += 1
        _scatter(out, alive, i)
        host = [out[j] - f if f >= 0 else 0 for j, f in enumerate(first_host)]
        return out, host

    def match_one(self, replica: int, hashes: Sequence[int]) -> int:
        """Longest cached prefix of ``hashes`` on one replica, in blocks. O(matched + 1)."""
        if not self._fly[replica]:
            return longest_cached_prefix(hashes, self._lru[replica])
        bit, where, n = 1 << replica, self._where, 0
        for h in hashes:
            if not where.get(h, 0) & bit:
                break
            n += 1
        return n

    def holds(self, replica: int, h: int) -> bool:
        """Whether ``replica`` is thought to hold block ``h`` (with ``pin_in_flight``, in flight
        there too). O(1)."""
        return h in self._lru[replica] or (self._pin and h in self._fly[replica])

    def blocks(self, replica: int) -> KeysView[int]:
        """The hashes ``replica`` holds, least recently touched first (a live view). O(1)."""
        return self._lru[replica].keys()

    def size(self, replica: int) -> int:
        """Blocks ``replica`` holds: the "tree size" the smallest-tree rules compare. O(1)."""
        return len(self._lru[replica]) + (len(self._fly[replica]) if self._pin else 0)

    def sizes(self) -> list[int]:
        """``size`` of every replica. O(num_replicas)."""
        if self._pin:
            return [len(lru) + len(fly) for lru, fly in zip(self._lru, self._fly, strict=True)]
        return [len(lru) for lru in self._lru]

    def __len__(self) -> int:
        """Distinct hashes held by at least one replica. O(1)."""
        return len(self._where)

    # -- approx mode -------------------------------------------------------------------------

    def record_routed(self, replica: int, hashes: Sequence[int]) -> int:
        """The router sent a request with prompt blocks ``hashes`` to ``replica``: assume the
        engine will hold them. Returns how many blocks aged out of that replica.

        Why: the approx index learns only from its own decisions (no engine events). The blocks
        are touched tail first, so the head of the prompt is the most recently touched and a
        request's tail ages out before its head: vLLM frees a request's blocks tail first for
        the same reason (a lost head block makes the rest of the chain unreachable). Blocks the
        replica already held are refreshed, which is how a lookup hit refreshes its blocks.
        In events mode the blocks are held in flight until ``release`` (returns 0); in approx
        mode with ``pin_in_flight`` too, and they leave the free pool (in use again), whose
        capacity shrinks by the blocks newly in flight.

        Complexity: O(len(hashes) + blocks aged out), amortised O(len(hashes)).
        """
        if self._mode == APPROX and not self._pin:
            return self._touch(replica, hashes)
        # In flight there from now on (pinned: out of the free pool too). A block already in
        # flight there, or held there, has its bit: only the others need it set. One pass (an
        # interpreted loop beats chained maps over these dicts); ``take(h, 1)`` is None for a
        # held block (``pop`` takes it out of the free pool, ``get`` leaves the events' cache).
        fly, lru, where, bit = self._fly[replica], self._lru[replica], self._where, 1 << replica
        fget, wget = fly.get, where.get
        take = lru.pop if self._pin else lru.get
        for h in hashes:
            c = fget(h, 0)
            fly[h] = c + 1
            if take(h, 1) is not None and not c:
                where[h] = wget(h, 0) | bit
        return self._age(replica) if self._pin else 0

    def release(self, replica: int, hashes: Sequence[int]) -> None:
        """A request routed to ``replica`` with prompt blocks ``hashes`` finished (or failed): in
        events mode its blocks stop counting as in flight (the engine's events say what it
        keeps); in approx mode with ``pin_in_flight`` likewise, with nothing added to the free
        pool (no report says what was computed). No-op in plain approx mode. O(len(hashes))."""
        if self._mode == APPROX and not self._pin:
            return
        lru = self._lru[replica]
        for h in filterfalse(lru.__contains__, self._unfly(replica, hashes)):
            self._unset(replica, h)

    def on_feedback(
        self,
        replica: int,
        hashes: Sequence[int],
        cached_tokens: int,
        block_size: int,
        estimated_blocks: int | None = None,
    ) -> int:
        """Correct the estimate with the cached-token count the engine reported for a request
        served on ``replica``; ``estimated_blocks`` is what the index matched for it at routing
        time. Returns how many blocks aged out.

        Why: the approx index does not see evictions. After the request's prefill every block of
        its prompt is in that engine's cache (the missed ones were just recomputed), so all of
        ``hashes`` are refreshed as present. What the report reveals is the index holding more
        than the replica keeps: a hit shorter than estimated means the engine had evicted blocks
        the index still listed. That replica's capacity estimate then shrinks by the overshoot
        (not below 1/8 of its configured capacity) and its oldest blocks age out; a hit at least
        as long as estimated grows the capacity back by 1/8 of the request's blocks, up to the
        configured capacity (additive decrease by the observed error, slow additive increase).
        In events mode it only releases the request's blocks from flight (returns 0). With
        ``pin_in_flight`` the prompt leaves flight first and joins the free pool as its most
        recent blocks (the capacity then bounds the free pool and the blocks in flight together).
        ``estimated_blocks=None`` leaves the capacity as it is: how a router reports a prompt
        that finished, or was sent, with no report to come (likely computed there).

        Complexity: O(len(hashes) + blocks aged out).
        """
        if self._mode != APPROX:
            self.release(replica, hashes)
            return 0
        if cached_tokens < 0 or block_size < 1:
            raise ValueError("cached_tokens must be >= 0 and block_size >= 1")
        hit = min(cached_tokens // block_size, len(hashes))
        cap, top = self._cap[replica], self._max_cap[replica]
        if cap is not None and top is not None and estimated_blocks is not None:
            if estimated_blocks > hit:
                self._cap[replica] = max(max(1, top // 8), cap - (estimated_blocks - hit))
            else:
                self._cap[replica] = min(top, cap + max(1, len(hashes) // 8))
        if not self._pin:
            return self._touch(replica, hashes)
        # Pinned: each block leaves flight once and is touched, tail first, in one pass: the
        # same end state as ``_unfly`` then ``_touch`` (the touch reads no flight count). A
        # block in flight there, or in the free pool, has its bit; only one in neither (a prompt
        # reported twice) needs it set.
        fly, lru, where, bit = self._fly[replica], self._lru[replica], self._where, 1 << replica
        fpop, wget, mte = fly.pop, where.get, lru.move_to_end
        for h in hashes[::-1]:
            c = fpop(h, 0)
            if c > 1:
                fly[h] = c - 1
            if h in lru:
                mte(h)
            else:
                lru[h] = None
                if not c:
                    where[h] = wget(h, 0) | bit
        return self._age(replica)

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        """Set a replica's configured capacity once it becomes known (a live replica reports
        its KV blocks after the router first sees it). O(1) plus the aging it causes."""
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        if self._max_cap[replica] == capacity_blocks:
            return
        self._max_cap[replica] = capacity_blocks
        self._cap[replica] = capacity_blocks
        self._age(replica)

    def capacity(self, replica: int) -> int | None:
        """The current capacity estimate of ``replica`` in blocks (None: unbounded). O(1)."""
        return self._cap[replica]

    # -- events mode -------------------------------------------------------------------------

    def on_kv_events(self, replica: int, events: Iterable[tuple[bool, int]]) -> None:
        """Apply an engine's KV events in order: ``(True, h)`` stored, ``(False, h)`` removed.

        Why: exact routing (Dynamo's and llm-d's precise mode). After the events of every step
        are applied, ``blocks(replica)`` equals the engine's prefix cache. A removal of a hash
        the index does not hold is ignored (events of a cache cleared before). No-op in approx
        mode. Complexity: O(len(events)); a run of stores is applied in bulk, as ``_touch`` does.
        """
        if self._mode != EVENTS:
            return
        lru = self._lru[replica]
        bit = 1 << replica
        where, fly = self._where, self._fly[replica]
        for stored, run in groupby(events, key=itemgetter(0)):
            hashes = list(map(itemgetter(1), run))
            if stored:  # a run of stores: new hashes in, then every one to the end in order (_touch)
                new = list(filterfalse(lru.__contains__, hashes))
                if new:
                    lru.update(zip(new, repeat(None)))
                    for h in new:
                        where[h] = where.get(h, 0) | bit
                deque(map(lru.move_to_end, hashes), maxlen=0)
                continue
            for h in hashes:
                if h in lru:
                    del lru[h]
                    if h not in fly:
                        self._unset(replica, h)

    def on_tier_events(self, replica: int, events: Iterable[tuple[bool, int]]) -> None:
        """Apply an engine's tier events in order (``BlockPool.tier_events``): ``(True, h)``
        ``h`` became host-only on ``replica`` (evicted from its GPU, kept in its host tier),
        ``(False, h)`` it stopped being host-only (back on the GPU, or gone from the host).

        Why: ``match_tiers`` prices a host hit as a reload, not a free GPU hit. Applied after
        the KV events of the same flush, the host-only set equals the engine's. No-op in approx
        mode (no tier information there). Complexity: O(len(events)).
        """
        if self._mode != EVENTS:
            return
        hset = self._host[replica]
        hwhere = self._hwhere
        bit = 1 << replica
        for host_only, h in events:
            if host_only:
                if h not in hset:
                    hset.add(h)
                    hwhere[h] = hwhere.get(h, 0) | bit
            elif h in hset:
                hset.discard(h)
                m = hwhere[h] & ~bit
                if m:
                    hwhere[h] = m
                else:
                    del hwhere[h]

    def host_only(self, replica: int) -> set[int]:
        """The hashes ``replica``'s engine holds in its host tier only (a live view). O(1)."""
        return self._host[replica]

    def replace_blocks(self, replica: int, hashes: Iterable[int], host_only: Iterable[int] = ()) -> None:
        """Events mode: ``replica``'s engine holds exactly ``hashes`` (a snapshot, or a replica's
        full resend after its events were lost), of which exactly ``host_only`` in its host tier
        only (engines with one); the prompts in flight to it stay counted. No-op in approx mode.
        O(blocks and host-only hashes held before + len(hashes) + len(host_only))."""
        if self._mode != EVENTS:
            return
        keep = set(hashes)
        lru = self._lru[replica]
        for h in [h for h in lru if h not in keep]:
            del lru[h]
            if h not in self._fly[replica]:
                self._unset(replica, h)
        self._clear_host(replica)
        self.on_kv_events(replica, ((True, h) for h in keep))
        self.on_tier_events(replica, ((True, h) for h in host_only))

    # -- internals ---------------------------------------------------------------------------

    def _clear_host(self, replica: int) -> None:
        hset = self._host[replica]
        if hset:
            self.on_tier_events(replica, [(False, h) for h in hset])

    def _unset(self, replica: int, h: int) -> None:
        m = self._where[h] & ~(1 << replica)
        if m:
            self._where[h] = m
        else:
            del self._where[h]

    def _unfly(self, replica: int, hashes: Sequence[int]) -> Sequence[int]:
        """One routing of ``hashes`` to ``replica`` leaves flight; returns the hashes no longer in
        flight there, their ``_where`` bits left as they are (the caller unsets or keeps them).
        O(len(hashes))."""
        fly = self._fly[replica]
        if all(map((1).__eq__, map(fly.get, hashes, repeat(0)))) and len(set(hashes)) == len(hashes):
            # the usual case, in bulk: each block in flight once, for this request only
            deque(map(fly.__delitem__, hashes), maxlen=0)
            return hashes
        gone = []
        for h in hashes:
            left = fly.get(h, 0) - 1
            if left > 0:
                fly[h] = left
            elif left == 0:
                del fly[h]
                gone.append(h)
        return gone

    def _touch(self, replica: int, hashes: Sequence[int]) -> int:
        """Mark ``hashes`` present on ``replica``, tail first (the head ends most recent), then
        age the replica to its capacity. Returns blocks aged out. O(len(hashes) + aged).

        Why in two sweeps: a prompt is hundreds of blocks, touched twice per request (routed,
        then fed back). Inserting the hashes new to the replica, then moving every hash to the
        end in touch order, leaves the same order as touching them one by one (each touched hash
        ends where its last touch puts it); the membership test and the moves run in
        ``filterfalse``/``map`` rather than an interpreted loop, and only the new hashes are
        visited one by one (inserted, with their ``_where`` bit)."""
        lru = self._lru[replica]
        rev = hashes[::-1]
        new = list(filterfalse(lru.__contains__, rev))
        k, n0 = len(new), len(lru)
        if k:
            bit = 1 << replica
            where = self._where
            for h in new:  # one loop for both: cheaper than OrderedDict.update, which adds per item
                lru[h] = None
                where[h] = where.get(h, 0) | bit
        # The new hashes now end the order, in touch order. When they are the first k touched and
        # distinct (a prompt's uncached tail: the usual case), moving the rest to the end
        # finishes the order and the new ones need no move.
        tail_new = len(lru) - n0 == k and rev[:k] == new
        deque(map(lru.move_to_end, rev[k:] if tail_new else rev), maxlen=0)
        return self._age(replica)

    def _age(self, replica: int) -> int:
        """Drop the least recently touched blocks while over capacity. O(blocks dropped)."""
        cap = self._cap[replica]
        if cap is None:
            return 0
        lru, fly = self._lru[replica], self._fly[replica]
        n = len(lru) - max(0, cap - len(fly)) if self._pin else len(lru) - cap
        if n <= 0:
            return 0
        where, keep = self._where, ~(1 << replica)
        for h in list(islice(lru, n)):  # the n oldest; _unset, inlined
            del lru[h]
            if h in fly:
                continue
            m = where[h] & keep
            if m:
                where[h] = m
            else:
                del where[h]
        return n


__all__ = ["APPROX", "EVENTS", "MODES", "PrefixIndex"]
