"""The queue-policy interface every host drives, and the column store policies share.

A policy owns one waiting queue and answers one question: which waiting request is admitted
next? It never awaits, never does I/O and never reads the wall clock: the host injects a
``Clock`` and feeds cache events. The simulator's engine model, the replica gate and the router
run the same objects.

Host protocol::

    policy.attach_cache(contains)          # read-only view of the prefix cache (block hash -> bool)
    policy.add(QueuedRequest(...))         # on arrival (or re-queue after preemption)
    req = policy.select()                  # choose; no state change but lazy lane promotion
    adm = policy.admit(req.rid)            # commit: remove from the queue, book the lane's share
    policy.on_blocks_stored(hashes) / policy.on_blocks_removed(hashes)   # cache events
    policy.on_step(prefill_tokens)         # after each engine step (token-clocked policies)

Why columns: every baseline's key is a vectorised expression over a few per-request columns
(arrival, prompt, cached tokens, estimated prefill time), so one ``select`` is a handful of numpy
passes over the live slots, O(n) with a small constant (tens of microseconds at n = 1,000), and a
cache event updates one slot in O(1). Keys that change with time (waiting time, response ratio)
need no re-heaping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.memory_view import KVMemoryView
from fairway.policies.hits import HitTracker, each_step

FAST = "fast"
FAIR = "fair"


@dataclass(slots=True)
class QueuedRequest:
    """A waiting request as a policy sees it.

    ``block_hashes`` are the prompt's chained block hashes; only the first
    ``(prompt_tokens - 1) // block_size`` can be served from cache (the engine always computes
    the last prompt token, as vLLM does).
    """

    rid: int
    arrival_s: float
    prompt_tokens: int
    block_hashes: Sequence[int]
    seq: int = 0  # host-owned tie-break counter; equal keys go to the smaller seq
    output_tokens: int = 0  # the host's output-length hint (the spec's length, or max_tokens); 0 = unknown
    priority_class: str = ""  # the request's class (fairway/policies/classes.py); "" = the default class
    tenant: str = ""  # who sent it ("" = no key): the flow a per-tenant fairness policy keys on


@dataclass(slots=True)
class Admission:
    """A committed decision. Invariants: ``0 <= cached_tokens < prompt_tokens``;
    ``waited_s >= 0``; ``lane`` is ``"fast"``/``"fair"`` for laned policies, else ``""``."""

    rid: int
    lane: str
    cached_tokens: int
    prompt_tokens: int
    est_prefill_s: float
    waited_s: float
    promoted: bool


class QueuePolicy(ABC):
    """Base class: column store + hit tracking. Subclasses implement ``_choose``.

    Complexity: ``add``/``admit`` O(hit blocks) and O(1) amortised column writes; ``select``
    O(n) vectorised; cache events O(requests touched).
    """

    name: ClassVar[str] = "base"
    has_lanes: ClassVar[bool] = False
    is_bound: ClassVar[bool] = False  # an oracle reference, not a product policy
    retention: ClassVar[str] = "lru"  # the engine model's eviction strategy this policy comes with
    takes_classes: ClassVar[bool] = False  # orders by request class: takes a ``classes`` option

    def __init__(self, clock: Clock, cost: CostModel, block_size: int = 16) -> None:
        self.clock = clock
        self.cost = cost
        self.block_size = block_size
        cap = 64
        self._rid = np.full(cap, -1, dtype=np.int64)
        self.active = np.zeros(cap, dtype=bool)
        self.arrival = np.zeros(cap)
        self.prompt = np.zeros(cap, dtype=np.int64)
        self.cached = np.zeros(cap, dtype=np.int64)
        self.prefill_s = np.zeros(cap)
        self.seq = np.zeros(cap, dtype=np.int64)
        self._hi = 0  # slots [0, _hi) may be live
        self._free: list[int] = []
        self._slot_of: dict[int, int] = {}
        self._items: dict[int, QueuedRequest] = {}
        self._tracker: HitTracker | None = None
        self._memory: KVMemoryView | None = None  # the host's memory view, if any
        self._feeding = False  # whether this queue declares its waiting hits to the view now
        self.processed_tokens = 0  # prefill tokens the engine has run (token clock)
        self.steps = 0

    # -- host protocol ---------------------------------------------------------------------

    def attach_cache(self, contains: Callable[[int], bool]) -> None:
        """Give the policy a read-only view of the prefix cache. Call before ``add``."""
        if self._items:
            raise RuntimeError("attach_cache must be called on an empty queue")
        self._tracker = HitTracker(contains, self._on_hit_change, self._on_hit_cut)

    def wants_memory_view(self) -> bool:
        """Whether this policy reads ``attach_memory``'s view (the host then counts the blocks
        its running requests hold, and the policy the blocks its waiting requests' hits need,
        which costs a little per request and per cache event)."""
        return False

    def memory_horizon_s(self) -> float:
        """How long the memory view should count a finished request's prompt as wanted (by the
        turn that may continue it): ``KVMemoryView``'s ``horizon_s``."""
        return 0.0

    def attach_memory(self, view: KVMemoryView) -> None:
        """Share the host's KV memory view (``fairway/memory_view.py``): from now on this queue
        declares its waiting requests' hits to it while the view counts (``feed_memory``: on
        arrival, as cache events move them, on leaving), and reads ``view.spare_blocks()``
        (free blocks no waiting request needs) and ``view.free_cached(hashes)`` (hit blocks no
        running request holds, which waiting can lose). Call after ``attach_cache``, on an
        empty queue. Hosts without a view leave it unset."""
        if self._items:
            raise RuntimeError("attach_memory must be called on an empty queue")
        if self._tracker is None:
            raise RuntimeError("attach_memory needs attach_cache first (the view follows the tracked hits)")
        self._memory = view
        view.attach_feeder(self)

    def feed_memory(self, on: bool) -> None:
        """Declare the waiting requests' hits to the memory view from now on (``on``: the current
        ones first, then each change) or stop: the view asks while it counts. O(waiting hits)."""
        tracker, view = self._tracker, self._memory
        assert tracker is not None and view is not None
        self._feeding = on
        if not on:
            tracker.set_listeners(self._on_hit_change, self._on_hit_cut)
            return
        tracker.set_listeners(self._hit_changed_with_memory, self._hit_cut_with_memory)
        for rid, req in self._items.items():
            hit = tracker.hit(rid)
            if hit:
                view.want(req.block_hashes[:hit])

    def _hit_changed_with_memory(self, rid: int, old: int, new: int) -> None:
        self._want_delta(rid, old, new)
        self._on_hit_change(rid, old, new)

    def _hit_cut_with_memory(self, rid: int, old: int, path: list[int]) -> None:
        self._want_delta(rid, old, path[-1])
        self._on_hit_cut(rid, old, path)

    def _want_delta(self, rid: int, old: int, new: int) -> None:
        """Declare ``rid``'s hit moving from ``old`` to ``new`` blocks to the memory view."""
        hashes = self._items[rid].block_hashes
        if new > old:
            self._memory.want(hashes[old:new])  # type: ignore[union-attr]
        elif new < old:
            self._memory.unwant(hashes[new:old])  # type: ignore[union-attr]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: int) -> bool:
        return rid in self._items

    def get(self, rid: int) -> QueuedRequest:
        """The waiting request ``rid`` (KeyError if it is not waiting). O(1)."""
        return self._items[rid]

    def add(self, req: QueuedRequest) -> None:
        if req.rid in self._items:
            raise KeyError(f"request {req.rid} is already queued")
        slot = self._free.pop() if self._free else self._grow()
        self._items[req.rid] = req
        self._slot_of[req.rid] = slot
        self._rid[slot] = req.rid
        self.active[slot] = True
        self.arrival[slot] = req.arrival_s
        self.prompt[slot] = req.prompt_tokens
        self.seq[slot] = req.seq
        hit = 0
        if self._tracker is not None:
            hit = self._tracker.add(req.rid, self._cacheable(req))
            if self._feeding and hit:
                self._memory.want(req.block_hashes[:hit])  # type: ignore[union-attr]
        self._set_cached(slot, hit)
        self._on_add(slot, req)

    def remove(self, rid: int) -> QueuedRequest:
        """Drop a request without admitting it (cancelled, or moved elsewhere)."""
        slot = self._slot_of.pop(rid)
        req = self._items.pop(rid)
        if self._tracker is not None:
            if self._feeding:
                self._memory.unwant(req.block_hashes[: self._tracker.hit(rid)])  # type: ignore[union-attr]
            self._tracker.remove(rid)
        self.active[slot] = False
        self._rid[slot] = -1
        self._free.append(slot)
        self._on_remove(slot)
        return req

    def select(self) -> QueuedRequest | None:
        """The request to admit next, or None if the queue is empty. Does not remove it."""
        if not self._items:
            return None
        slot = self._choose(self.clock.now())
        return None if slot < 0 else self._items[int(self._rid[slot])]

    def admit(self, rid: int) -> Admission:
        """Commit the admission of ``rid`` (normally the one ``select`` returned)."""
        slot = self._slot_of[rid]
        now = self.clock.now()
        lane, promoted = self._lane_of(slot)
        adm = Admission(
            rid=rid,
            lane=lane,
            cached_tokens=int(self.cached[slot]),
            prompt_tokens=int(self.prompt[slot]),
            est_prefill_s=float(self.prefill_s[slot]),
            waited_s=max(0.0, now - float(self.arrival[slot])),
            promoted=promoted,
        )
        self._on_admit(slot, adm)
        self.remove(rid)
        return adm

    def cached_tokens(self, rid: int) -> int:
        return int(self.cached[self._slot_of[rid]])

    def hit_blocks(self, rid: int) -> int | None:
        """The cached prefix of waiting ``rid`` in blocks, as the hit tracker keeps it (equal to
        a fresh walk of the attached cache view), or None where this policy keeps no tracker of
        its own (a group of inner policies). O(1): a host reads it instead of walking the prompt."""
        return self._tracker.hit(rid) if self._tracker is not None else None

    def on_blocks_stored(self, hashes: Iterable[int]) -> None:
        if self._tracker is not None:
            self._tracker.on_stored(hashes)

    def on_blocks_removed(self, hashes: Iterable[int]) -> None:
        if self._tracker is not None:
            self._tracker.on_removed(hashes)

    def on_step(self, prefill_tokens: int) -> None:
        """The engine ran one step with ``prefill_tokens`` prompt tokens (token clock)."""
        self.processed_tokens += prefill_tokens
        self.steps += 1

    def lane_sizes(self) -> dict[str, int]:
        """Waiting requests per lane (empty for policies without lanes)."""
        return {}

    def queued_prefill_s(self) -> float:
        """Estimated prefill seconds of every waiting request at its current hit. O(n)."""
        hi = self._hi
        return float(self.prefill_s[:hi][self.active[:hi]].sum())

    def work_ahead_s(self, priority_class: str = "") -> float:
        """Estimated prefill seconds a new request of ``priority_class`` waits for before it
        starts: all the queued work for a policy that ignores classes; class-aware policies
        count only the work their order puts ahead of it. O(n)."""
        return self.queued_prefill_s()

    def best_tier(self) -> int:
        """The strictest request-class tier among the waiting requests (lower first): 0 for a
        policy that ignores classes. A host that orders several queues (a gate's tenants) serves
        the strictest tier first. O(1) here."""
        return 0

    def lower_tier(self, priority_class: str) -> bool:
        """Whether class ``priority_class`` is of a tier below the strictest one configured (an
        engine may keep prefill room for the strictest tier): False for a policy that ignores
        classes. O(1) here."""
        return False

    def strict_waiting(self) -> bool:
        """Whether a request of the strictest tier configured waits: False for a policy that
        ignores classes (no tier is kept room for). O(1) here."""
        return False

    def may_hold_first_step(self, rid: int) -> bool:
        """Whether the host may hold waiting ``rid`` back one step for the requests whose first
        token that step brings (``FairwayConfig.first_step_hold``; the host prices the hold). No
        by default. O(1)."""
        return False

    def preempt_victim(self, running: Sequence[int]) -> int:
        """Index into ``running`` (admission order) of the request to preempt: the newest, as
        vLLM does for FCFS."""
        return len(running) - 1

    # -- subclass hooks --------------------------------------------------------------------

    @abstractmethod
    def _choose(self, now: float) -> int:
        """Slot of the request to admit next among live slots (there is at least one)."""

    def _on_add(self, slot: int, req: QueuedRequest) -> None:  # noqa: B027 - optional hook
        pass

    def _on_remove(self, slot: int) -> None:  # noqa: B027 - optional hook
        pass

    def _on_admit(self, slot: int, adm: Admission) -> None:  # noqa: B027 - optional hook
        pass

    def _lane_of(self, slot: int) -> tuple[str, bool]:
        return "", False

    # -- helpers ---------------------------------------------------------------------------

    def _n_cacheable(self, req: QueuedRequest) -> int:
        """How many of the prompt's blocks a cache can hold: the full blocks before its last token."""
        return min(len(req.block_hashes), max(0, (req.prompt_tokens - 1) // self.block_size))

    def _cacheable(self, req: QueuedRequest) -> Sequence[int]:
        hs = req.block_hashes
        n = self._n_cacheable(req)
        return hs if len(hs) <= n else hs[:n]

    def _at_risk(self, slot: int) -> int:
        """Blocks of ``slot``'s cache hit that no running request holds (all of the hit without a
        memory view). O(hit blocks)."""
        n = int(self.cached[slot]) // self.block_size
        if not n or self._memory is None:
            return n
        return self._memory.free_cached(self._items[int(self._rid[slot])].block_hashes[:n])

    def _new_blocks(self, slot: int) -> int:
        """KV blocks ``slot``'s admission allocates beyond its cache hit (as the engine plans it)."""
        bs = self.block_size
        return -(-int(self.prompt[slot]) // bs) - int(self.cached[slot]) // bs

    def _set_cached(self, slot: int, hit_blocks: int) -> None:
        c = hit_blocks * self.block_size
        self.cached[slot] = c
        self.prefill_s[slot] = self.cost.prefill_time(int(self.prompt[slot]) - c, c)

    def _on_hit_change(self, rid: int, old: int, new: int) -> None:
        self._set_cached(self._slot_of[rid], new)

    def _on_hit_cut(self, rid: int, old: int, path: list[int]) -> None:
        """A batch of evictions cut ``rid``'s hit from ``old`` through ``path`` (decreasing,
        ending at the new hit; ``HitTracker``): each step is an ``_on_hit_change``, in order.
        Subclasses may fold the path in one update with the same result. O(len(path))."""
        each_step(self._on_hit_change, rid, old, path)

    def _grow(self) -> int:
        if self._hi == len(self.active):
            n = len(self.active) * 2
            for name in ("_rid", "active", "arrival", "prompt", "cached", "prefill_s", "seq"):
                old = getattr(self, name)
                new = np.full(n, -1, dtype=old.dtype) if name == "_rid" else np.zeros(n, old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
            self._grow_extra(n)
        self._hi += 1
        return self._hi - 1

    def _grow_extra(self, n: int) -> None:  # noqa: B027 - optional hook
        """Subclasses with extra columns resize them to ``n`` here."""

    def _live(self) -> np.ndarray:
        """Boolean mask of live slots in [0, _hi)."""
        return self.active[: self._hi]

    def _argmin(self, key: np.ndarray, mask: np.ndarray | None = None) -> int:
        """Slot with the smallest key among ``mask`` (default: live); ties -> smallest seq.
        O(n) vectorised."""
        live = self._live() if mask is None else mask
        k = np.where(live, key, np.inf)
        m = k.min()
        if m == np.inf:
            # all keys +inf among live slots: fall back to seq order among live
            cand = np.flatnonzero(live)
        else:
            cand = np.flatnonzero(k == m)
        if cand.size == 1:
            return int(cand[0])
        return int(cand[np.argmin(self.seq[cand])])


def grow_column(arr: np.ndarray, n: int) -> np.ndarray:
    new = np.zeros(n, dtype=arr.dtype)
    new[: len(arr)] = arr
    return new
