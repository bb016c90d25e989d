"""PEEK: cluster pioneers first, siblings once the prefix is cached, a stride over three lanes.

A baseline (``PUBLISHED_BASELINES``), rebuilt from the published description (docs/design.md, PEEK and PRISM):

- **Pending tree and hits.** ``DemandQueue`` keeps the radix tree of the waiting requests'
  blocks; every waiting request's longest cached prefix is kept current by the base class's hit
  tracker from cache events (``PendingTree.dual_walk`` computes the same from scratch).
- **Pioneers first.** A waiting request whose next uncached block is needed by at least one
  other waiting request heads a cold shared prefix. Once one request of such a cluster is
  admitted, its siblings are **held** (not admitted) until the blocks they would share are
  stored, so each shared prefix is computed once; they then follow with a hit. A hold also ends
  when the pioneer is re-queued or at its deadline (``DemandQueue``). ``select`` returns None
  when every waiting request is held: the engine runs the pioneer and comes back.
- **Lanes.** Three orders over the requests not held, each a key over the columns:
  ``pioneer`` (requests heading a shared cold prefix, most queued demand first), ``reuse`` (most
  cached tokens first) and ``oldest`` (arrival order). A stride scheduler picks the lane: each
  lane has a pass, the non-empty lane with the smallest pass admits (ties in that lane order),
  and its pass grows by the admission's charge / the lane's tickets, where the charge is the
  admitted request's estimated prefill time (``charge="work"``, stride scheduling's "resource
  used") or 1 (``charge="admissions"``); a lane that was empty restarts no earlier than the
  largest pass of the lanes that stayed non-empty (it banks no credit).
- **Starvation bound.** A lane's pass never falls a full charge behind the ``oldest`` lane's, so
  between two admissions of the ``oldest`` lane each other lane admits at most
  (its tickets / oldest tickets) x the oldest lane's last charge, plus one request. With
  ``charge="admissions"`` and equal tickets: the oldest request not held is admitted within 3
  admissions, any request within 3 x (requests older than it + 1). With ``charge="work"`` the
  same holds in prefill seconds instead of admissions. Time spent held adds to this, bounded by
  the hold deadline.
- **Retention.** ``retention = "peek"``: the engine model keeps every cached block on the
  cacheable prefix of a waiting request out of eviction while an unwanted one is free (its own
  demand count, ``BlockPool.add_demand``).

Complexity: ``select`` O(n) vectorised (three masked argmins at most, one used); ``admit``
O(uncached blocks of the admitted request); the rest as ``DemandQueue``.
"""

from __future__ import annotations

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import Admission
from fairway.policies.demand import DemandQueue

PIONEER = "pioneer"
REUSE = "reuse"
OLDEST = "oldest"
LANES = (PIONEER, REUSE, OLDEST)


class PEEK(DemandQueue):
    """PEEK queue policy. Options: ``pioneer_tickets``, ``reuse_tickets``, ``oldest_tickets``
    (the lanes' stride shares, equal by default: no lane is favoured without a workload to tune
    on), ``charge`` ("work" or "admissions"), ``hold_factor`` and ``p_floor_s`` (the hold
    deadline, see ``DemandQueue``)."""

    name = "peek"
    retention = "peek"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        pioneer_tickets: float = 1.0,
        reuse_tickets: float = 1.0,
        oldest_tickets: float = 1.0,
        charge: str = "work",
        hold_factor: float = 4.0,
        p_floor_s: float = 0.1,
    ) -> None:
        super().__init__(clock, cost, block_size, hold_factor=hold_factor, p_floor_s=p_floor_s)
        tickets = {PIONEER: pioneer_tickets, REUSE: reuse_tickets, OLDEST: oldest_tickets}
        if not all(t > 0 for t in tickets.values()):
            raise ValueError("lane tickets must be > 0")
        if charge not in ("work", "admissions"):
            raise ValueError(f"unknown charge {charge!r}")
        self.charge = charge
        self.stride = {lane: 1.0 / t for lane, t in tickets.items()}
        self.passes = dict.fromkeys(LANES, 0.0)
        self._nonempty = dict.fromkeys(LANES, False)
        self.lane_admissions = dict.fromkeys(LANES, 0)
        self._chosen = (-1, "")

    def _choose(self, now: float) -> int:
        self._expire(now)
        hi = self._hi
        ok = self._not_held()
        if not ok.any():
            self._chosen = (-1, "")
            return -1
        masks = {
            PIONEER: ok & (self.front_demand[:hi] >= 2),
            REUSE: ok & (self.cached[:hi] > 0),
            OLDEST: ok,
        }
        lane = self._pick_lane({lane: bool(m.any()) for lane, m in masks.items()})
        if lane == PIONEER:
            slot = self._argmin(-self.front_demand[:hi].astype(float), masks[PIONEER])
        elif lane == REUSE:
            slot = self._argmin(-self.cached[:hi].astype(float), masks[REUSE])
        else:
            slot = self._argmin(self.arrival[:hi], ok)
        self._chosen = (slot, lane)
        return slot

    def _pick_lane(self, nonempty: dict[str, bool]) -> str:
        """The non-empty lane with the smallest pass; a lane that was empty restarts no earlier
        than the largest pass of the lanes that stayed non-empty, so it can never run ahead of
        them (the starvation bound rests on this). O(lanes)."""
        was = [self.passes[lane] for lane in LANES if self._nonempty[lane] and nonempty[lane]]
        floor = max(was) if was else max(self.passes.values())
        for lane in LANES:
            if nonempty[lane] and not self._nonempty[lane]:
                self.passes[lane] = max(self.passes[lane], floor)
            self._nonempty[lane] = nonempty[lane]
        return min((lane for lane in LANES if nonempty[lane]), key=lambda x: self.passes[x])

    def _on_admit(self, slot: int, adm: Admission) -> None:
        super()._on_admit(slot, adm)
        chosen, lane = self._chosen
        self._chosen = (-1, "")
        if chosen != slot:  # admitted without a select (a host's override): charge the oldest lane
            lane = OLDEST
        cost = adm.est_prefill_s if self.charge == "work" else 1.0
        self.passes[lane] += cost * self.stride[lane]
        self.lane_admissions[lane] += 1
