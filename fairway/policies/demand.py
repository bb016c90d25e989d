"""Shared state of the demand-aware policies (PEEK, PRISM): queued demand and in-flight blocks.

- **Queued demand.** A ``PendingTree`` over the waiting requests' cacheable blocks. Each waiting
  request's *frontier* is its first uncached cacheable block; ``front_demand`` (a column) is how
  many waiting requests need that block, itself included: 2 or more means the request heads a
  prefix-sharing cluster whose next block nobody has computed yet.
- **In flight.** An admitted request will store the uncached cacheable blocks of its prompt. Until
  the cache reports them stored, a waiting request whose frontier is one of them would compute
  the same block again; ``held`` (a column) marks such requests. A hold ends when the block is
  stored, when the admitted request comes back to the queue (preempted), or at its deadline,
  admission + ``hold_factor`` x max(P, ``p_floor_s``) (P: the admitted request's estimated
  prefill time), so a request the host dropped without telling the policy holds nobody forever.
  Holds that end by deadline are counted in ``hold_expiries``.
- **Demand per block.** ``queued_demand(h)``: the number of waiting requests whose cacheable
  prefix holds block ``h``. The engine model's retention keeps its own count
  (``BlockPool.add_demand``), since it must also count requests a policy does not hold (held by
  the admission gate, or any policy under ``--retention``).

Complexity: ``add`` / ``remove`` O(blocks of the request + requests whose frontier is one of
them); a cache event O(requests whose frontier it is), on top of the base class's hit tracking;
``admit`` O(uncached blocks); expiry O(log holds) per hold; the columns make ``select`` a few
vectorised passes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy, grow_column
from fairway.policies.pending_tree import PendingTree


class DemandQueue(QueuePolicy):
    """Base class: pending tree, frontier demand and in-flight holds. Subclasses implement
    ``_choose`` (call ``_expire(now)`` first)."""

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        hold_factor: float = 4.0,
        p_floor_s: float = 0.1,
    ) -> None:
        super().__init__(clock, cost, block_size)
        if not hold_factor >= 0:
            raise ValueError("hold_factor must be >= 0")
        if not p_floor_s >= 0:
            raise ValueError("p_floor_s must be >= 0")
        self.hold_factor = hold_factor
        self.p_floor_s = p_floor_s
        self.tree = PendingTree()
        self.front_demand = np.zeros(len(self.active), dtype=np.int64)
        self.held = np.zeros(len(self.active), dtype=bool)
        self.held_selects = 0  # selects that found every waiting request held
        self._inflight: dict[int, set[int]] = {}  # hash -> admitted rids computing it
        self._holders: dict[int, tuple[int, Sequence[int]]] = {}  # admitted rid -> (generation, hashes)
        self._expiry: list[tuple[float, int, int]] = []  # (deadline, generation, rid) min-heap
        self._gen = 0
        self.hold_expiries = 0
        # the hit tracker also indexes who waits at each frontier block; a host's cache replaces
        # this empty one (nothing cached: every frontier is the first block)
        self.attach_cache(lambda h: False)

    # -- public views ----------------------------------------------------------------------

    def queued_demand(self, h: int) -> int:
        """Waiting requests whose cacheable prefix holds block ``h`` (for retention). O(1)."""
        return self.tree.demand(h)

    def in_flight(self, h: int) -> bool:
        """Whether an admitted request is computing block ``h`` and has not stored it. O(1)."""
        return h in self._inflight

    # -- columns ---------------------------------------------------------------------------

    def _grow_extra(self, n: int) -> None:
        self.front_demand = grow_column(self.front_demand, n)
        self.held = grow_column(self.held, n)

    def _not_held(self) -> np.ndarray:
        """The live slots in [0, _hi) not held; counts a select that finds all of them held."""
        hi = self._hi
        ok = self.active[:hi] & ~self.held[:hi]
        if not ok.any():
            self.held_selects += 1
        return ok

    def _set_front(self, rid: int, slot: int) -> None:
        """Recompute ``rid``'s frontier columns from its hit (the hit tracker indexes the
        frontier itself). O(1)."""
        hashes = self.tree.path(rid)
        hit = int(self.cached[slot]) // self.block_size
        if hit < len(hashes):
            h = hashes[hit]
            self.front_demand[slot] = self.tree.demand(h)
            self.held[slot] = h in self._inflight
        else:
            self.front_demand[slot] = 0
            self.held[slot] = False

    def _refresh_demand(self, hashes: Iterable[int]) -> None:
        """Demand changed on ``hashes``: update the requests whose frontier is one of them."""
        frontier, slot_of, fd, tree = self._frontier(), self._slot_of, self.front_demand, self.tree
        for h in hashes:
            rids = frontier.get(h)
            if rids:
                d = tree.demand(h)
                for r in rids:
                    fd[slot_of[r]] = d

    def _frontier(self) -> Mapping[int, set[int]]:
        """Block hash -> the waiting requests whose first uncached block it is: the hit
        tracker's own index. O(1)."""
        assert self._tracker is not None
        return self._tracker.frontier

    def _set_held(self, rids: set[int], value: bool) -> None:
        held, slot_of = self.held, self._slot_of
        for r in rids:
            held[slot_of[r]] = value

    # -- queue hooks -----------------------------------------------------------------------

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        if req.rid in self._holders:  # back from preemption: its blocks are not coming
            self._release(req.rid)
        hashes = self._cacheable(req)
        self.tree.add(req.rid, hashes)
        self._refresh_demand(hashes)
        self._set_front(req.rid, slot)

    def remove(self, rid: int) -> QueuedRequest:
        req = super().remove(rid)
        self._refresh_demand(self.tree.remove(rid))
        return req

    def _on_hit_change(self, rid: int, old: int, new: int) -> None:
        super()._on_hit_change(rid, old, new)
        self._set_front(rid, self._slot_of[rid])

    def _on_admit(self, slot: int, adm: Admission) -> None:
        rid = adm.rid
        hashes = self.tree.path(rid)[adm.cached_tokens // self.block_size:]
        if not hashes or self.hold_factor == 0:
            return
        self._gen += 1
        self._holders[rid] = (self._gen, hashes)
        deadline = self.clock.now() + self.hold_factor * max(adm.est_prefill_s, self.p_floor_s)
        heapq.heappush(self._expiry, (deadline, self._gen, rid))
        inflight, frontier = self._inflight, self._frontier()
        for h in hashes:
            s = inflight.get(h)
            if s is None:
                inflight[h] = {rid}
                if h in frontier:
                    self._set_held(frontier[h], True)
            else:
                s.add(rid)

    def on_blocks_stored(self, hashes: Iterable[int]) -> None:
        hs = list(hashes)
        frontier = self._frontier()
        for h in hs:
            if self._inflight.pop(h, None) is not None and h in frontier:
                self._set_held(frontier[h], False)
        super().on_blocks_stored(hs)

    # -- holds -----------------------------------------------------------------------------

    def _release(self, rid: int) -> bool:
        """End ``rid``'s hold on the blocks it has not stored; True if any was still held."""
        _, hashes = self._holders.pop(rid)
        inflight, frontier = self._inflight, self._frontier()
        any_held = False
        for h in hashes:
            s = inflight.get(h)
            if s is not None and rid in s:
                s.discard(rid)
                if not s:
                    del inflight[h]
                    if h in frontier:
                        self._set_held(frontier[h], False)
                        any_held = True
        return any_held

    def _expire(self, now: float) -> None:
        """End the holds whose deadline passed. O(log holds) each."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, gen, rid = heapq.heappop(heap)
            entry = self._holders.get(rid)
            if entry is not None and entry[0] == gen and self._release(rid):
                self.hold_expiries += 1
