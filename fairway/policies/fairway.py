"""Fairway: two virtual lanes over one waiting queue (docs/design.md, Fairway queue policy).

- A request is in the **Fast lane** until it has waited W >= theta * max(P, P_floor), where P is
  its current estimated prefill time (uncached tokens on top of cached ones); then it is
  promoted, for good, to the **Fair lane**.
- Fast lane order: least uncached work first (reuse-first measured as the work reuse leaves).
- Fair lane order (default ``"edf"``): earliest deadline first, deadline = arrival +
  theta * max(P, P_floor), i.e. the moment the request was due for promotion. Deadlines are
  static while hits are, so a Fair-lane request is overtaken in its lane only by requests whose
  deadline is earlier: at most the requests that arrived before its deadline, under any load.
  ``"ratio"`` (highest W / max(P, P_floor), the reference design's order) is kept as an option: it
  lets a stream of cheap promoted requests (ratio growing at 1 / P_floor) starve an expensive
  one for as long as an overload lasts (tests/sim/test_simulator.py shows it; docs/benchmarks.md compares).
- Capacity split: stride scheduling over estimated prefill work. Each lane has a pass; admit from
  the non-empty lane with the smaller pass, then add P / share to that lane's pass. A lane that
  was empty restarts at the other lane's pass (it banks no credit); an empty lane gives the other
  everything.
- ``fast_ahead`` (0.1): on the Fair lane's turn, a Fast pick with at most that fraction of the
  Fair pick's P goes first while the Fast lane stays within one Fair quantum of the Fair lane's
  pass, so a long Fair pick does not take a whole engine step ahead of cached requests
  (``FairwayConfig``).
- ``lost_blocks`` (65,536; 0 turns it off): the deadline counts as cached the context this replica
  computed for the request and lost before it arrived (a bounded memory of the last block of
  each admitted prompt, ``lost_scope="turns"``, or of recently evicted block hashes, "evicted"),
  as ``sticky_due`` does for what is evicted while it waits: losing a conversation's context
  between its turns is the queue's doing, not the request's, so a follow-up turn is due as if
  its context were still there (``FairwayConfig``).
- P and lanes are re-evaluated at decision time from hit lengths that the base class keeps
  current from cache events (no queue rescans of prompts).
- ``memory_guard`` (on by default; reads the host's memory view, ``fairway/memory_view.py``,
  which the engine model and the replica gate both keep, and acts only while ``guard_loss`` of
  the recently admitted prefill recomputes context that requests lost while they waited): when an
  admission would evict more of waiting requests' cached context than it saves of its own, the
  Fast lane orders by longest cached prefix instead of least work, and a Fair-lane pick that would
  do so yields to a Fast pick that would not. Why: in a memory-bound closed loop (agentic,
  ``--concurrency 100``, ``--rate`` 1-4) the Fair lane's cold admissions and the Fast lane's
  new-session first turns evict the contexts of sessions whose next turn is waiting, and the
  recompute halves throughput (docs/design.md, Memory guard). With ``guard_aging`` > 0 (an
  option) a pick that still evicts gives way instead to the longest cached prefix of the whole
  queue, a request past its deadline gaining ``guard_aging`` tokens for every second it is late
  (LPM with aging, from the deadline on), so an overdue request is not passed over for as long as
  memory binds.

Complexity: ``select`` is O(n) vectorised over the live slots (a few numpy passes); promotion is
found in the same pass; ``admit`` is O(1) plus the base class's removal; ``add`` walks the
prompt's blocks past its hit once (the evicted prefix); an eviction event is O(1) per block.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.memory_view import KVMemoryView
from fairway.policies.base import FAIR, FAST, Admission, QueuedRequest, QueuePolicy, grow_column
from fairway.policies.evicted import EvictedBlocks

LOSS_DECAY = 0.99  # guard_loss: each admission's weight in the decayed shares decays by this per admission


@dataclass(frozen=True, slots=True)
class FairwayConfig:
    """Fairway's knobs. The defaults are fixed across workloads (no per-workload tuning).

    theta: promotion threshold, in multiples of the request's own prefill time (> 0).
    p_floor_s: floor on P in the promotion test and the Fair-lane key, so fully cached requests
        do not promote at once (seconds, >= 0).
    fair_share: the Fair lane's share of admitted prefill work under contention (0 < s < 1);
        the Fast lane gets 1 - fair_share.
    fast_order: "least-work" (least uncached prefill time) or "most-cached" (longest prefix).
    fair_order: "edf" (earliest arrival + theta * max(P, floor)) or "ratio" (highest W / max(P, floor)).
    fast_scope: "unpromoted" (the Fast lane picks among requests not yet promoted) or "all" (the
        Fast lane's pick is the least-work request of the whole queue, promoted or not, so under
        overload, when everything has been promoted, cheap requests keep the Fast lane's share).
    sticky_due: the deadline arrival + theta * max(P, floor) only ever moves earlier (a hit that
        grows while waiting pulls it in; an eviction does not push it out). Off: recomputed from
        the current P at every change.
    memory_guard: with the host's memory view (``attach_memory``; the simulator's engine model
        and the replica gate keep one for a policy that asks): a Fair-lane pick whose
        admission would evict more cached context of waiting requests than it saves of its own
        (new blocks beyond the free blocks nobody waiting needs > its hit blocks that no running
        request holds, which its waiting puts at risk) yields the decision to the Fast lane's
        pick when that one saves at least as much as it evicts.
    guard_overdue: with memory_guard, the guard acts only while at least this share of the
        waiting requests are promoted (overdue: a sustained overload rather than a spike);
        0 = whenever memory binds (docs/history/2026-12-03-agentic-guard-trigger.md).
    guard_horizon_s: with memory_guard, a finished request's prompt counts as needed (by the
        turn that may continue it) for this long after it finished (seconds, >= 0): between two
        turns of a conversation or an agent's loop nobody waits for the context yet.
    guard_loss: with memory_guard, the guard acts only while at least this share of the recently
        admitted prefill is recompute of context the requests had cached while they waited and
        lost before admission (the queue order destroying what the guard protects; decayed over
        about the last 100 admissions); 0 = whenever memory binds. Until then the host's memory
        view keeps no counts (``KVMemoryView.need``).
    guard_aging: with memory_guard, tokens per second (>= 0). 0 (default): a Fair-lane pick
        that evicts yields to a Fast-lane pick that does not, however late it is. > 0: while the
        guard acts, a pick that evicts more of waiting requests' context than it keeps of its
        own gives way to the request with the largest cached tokens + guard_aging x seconds past
        its deadline (arrival + theta * max(P, floor)), whatever it evicts. 50 is SGLang's
        LPM-with-aging rate (25 tokens per scheduling pass) at a full 8,192-token step of the
        default profile (0.3-0.6 s). Not the default: it wins on the closed agentic loops under
        the default step costs (not under the measured ones) and loses on the open-loop
        memory-bound spikes (docs/history/2026-12-04-guard-aging.md).
    fast_ahead: in [0, 1), default 0.1. On the Fair lane's turn, the Fast lane's pick goes first
        when its prefill is at most fast_ahead x the Fair pick's, charged to the Fast lane, while
        the Fast lane's pass stays within one Fair quantum (the Fair pick's prefill / fair_share)
        of the Fair lane's. Why: an engine with a per-step token budget runs the prefill it
        admits in admission order, so a long Fair pick admitted first takes its step's whole
        budget and the light requests behind it wait a step; ahead of it they cost it a few
        tokens. The lanes' shares are the stride's; only the order within a quantum changes.
        0: the Fair pick first on its turn (the rule before 2026-12-05).
    lost_blocks: with ``sticky_due``, how many block hashes the queue remembers of the context
        this replica computed (``lost_scope``; >= 0; oldest forgotten first; 0 remembers none),
        so that a request's deadline counts the context this replica computed
        for it and lost before it arrived as cached: arrival + theta * max(P with that prefix
        cached, floor). Why: in a memory-bound agentic load a session's context is evicted
        between its turns while other requests run, and its next turn then arrives with a
        prefill many times its own new tokens' and a deadline as late; the expensive, late-due
        turns made the tail (docs/design.md, Lost context). The default, 65,536: with
        ``lost_scope="turns"`` that many admitted prompts (1.8 hours at 10 requests a second);
        with "evicted", about one GPU pool of an 8B model on an H200 (55,291 blocks), as much as
        the cache holds, as ARC's ghost lists do. On by default since 2026-12-07: with "turns"
        it meets the queue target on the agentic spike on one replica, and leaves the Fairway
        router's 8-replica runs the same to the bit wherever no replica's memory binds
        (docs/benchmarks.md 2.3).
    lost_scope: what ``lost_blocks`` remembers. "turns" (the default): the last block of each
        prompt this replica admitted, so only a prompt that continues one this replica served
        counts, up to the deepest such block: a conversation's own context, not a prefix it
        shares with other conversations. "evicted": every block hash the cache dropped, so any
        remembered prefix counts, a shared one included (the first form, 2026-12-06). Why
        "turns": on the Mooncake trace the evicted prefixes that come back are mostly shared
        ones; "turns" keeps the one-replica gain and leaves the Fairway router's 8-replica runs
        the same or within 1-3% at all but one point (better on the held-out conversation
        trace), where "evicted" cost them 1-5%
        (docs/design.md, Lost context).
    first_step_hold: the host may hold a request back one step (``may_hold_first_step``) while it
        is not promoted: an engine with a per-step token budget puts a chunk of every prompt it
        admits into the same step as the requests whose first token that step brings, and each
        of those then waits for the chunk. The host holds the prompt when that delay outweighs
        the hold's cost (its own step, and the capacity the shorter step leaves unused for
        everyone waiting; docs/design.md, First-step hold). How long: only while it has waited
        less than its own prefill time P, never once promoted, and once at most where its
        prefill would end in the step. On by default since 2026-12-07: it cuts the median by
        half or more on bursty traffic where longer prompts land among short ones, and moves
        the other workloads' figures by a few percent, mostly down.
    """

    theta: float = 12.0
    p_floor_s: float = 0.1
    fair_share: float = 0.6
    fast_order: str = "least-work"
    fair_order: str = "edf"
    sticky_due: bool = True
    fast_scope: str = "all"
    memory_guard: bool = True
    guard_overdue: float = 0.0
    guard_horizon_s: float = 10.0
    guard_loss: float = 0.1
    guard_aging: float = 0.0
    fast_ahead: float = 0.1
    lost_blocks: int = 65536
    lost_scope: str = "turns"
    first_step_hold: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.first_step_hold, bool):
            raise ValueError(f"first_step_hold must be true or false, got {self.first_step_hold!r}")
        if self.lost_scope not in ("evicted", "turns"):
            raise ValueError(f"unknown lost_scope {self.lost_scope!r}")
        if isinstance(self.lost_blocks, bool) or not isinstance(self.lost_blocks, int) or self.lost_blocks < 0:
            raise ValueError("lost_blocks must be an integer >= 0 (a count of block hashes)")
        if not 0.0 <= self.fast_ahead < 1.0:
            raise ValueError("fast_ahead must be in [0, 1)")
        if not self.theta > 0:
            raise ValueError("theta must be > 0")
        if self.p_floor_s < 0:
            raise ValueError("p_floor_s must be >= 0")
        if not 0.0 < self.fair_share < 1.0:
            raise ValueError("fair_share must be in (0, 1)")
        if not 0.0 <= self.guard_loss <= 1.0:
            raise ValueError("guard_loss must be in [0, 1]")
        if self.guard_horizon_s < 0:
            raise ValueError("guard_horizon_s must be >= 0")
        if not 0.0 <= self.guard_overdue <= 1.0:
            raise ValueError("guard_overdue must be in [0, 1]")
        if not self.guard_aging >= 0:
            raise ValueError("guard_aging must be >= 0")
        if self.fast_order not in ("least-work", "most-cached"):
            raise ValueError(f"unknown fast_order {self.fast_order!r}")
        if self.fast_scope not in ("unpromoted", "all"):
            raise ValueError(f"unknown fast_scope {self.fast_scope!r}")
        if self.fair_order not in ("ratio", "edf"):
            raise ValueError(f"unknown fair_order {self.fair_order!r}")


class Fairway(QueuePolicy):
    """The Fairway dual-lane policy. See the module docstring for the rules."""

    name = "fairway"
    has_lanes = True

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        config: FairwayConfig | None = None,
        **overrides: object,
    ) -> None:
        super().__init__(clock, cost, block_size)
        base = config or FairwayConfig()
        if overrides:
            fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
            unknown = set(overrides) - set(fields)
            if unknown:
                raise TypeError(f"unknown Fairway option(s): {', '.join(sorted(unknown))}")
            fields.update(overrides)
            base = FairwayConfig(**fields)  # type: ignore[arg-type]
        self.config = base
        self.promoted = np.zeros(len(self.active), dtype=bool)
        self.promoted_at = np.zeros(len(self.active))
        self.due = np.zeros(len(self.active))  # arrival + theta * max(P, floor), never later
        self.peak = np.zeros(len(self.active), dtype=np.int64)  # most cached tokens seen while waiting
        self._lost = 0.0  # recent admissions: cached tokens lost while waiting, decayed (guard_loss)
        self._prefilled = 0.0  # and their uncached prompt tokens, decayed alike
        self.passes = {FAST: 0.0, FAIR: 0.0}
        self.shares = {FAST: 1.0 - base.fair_share, FAIR: base.fair_share}
        self._nonempty = {FAST: False, FAIR: False}
        self.promotions = 0
        self.yields = 0  # admissions the memory guard made in place of the lanes' pick (the aged pick; a yield)
        self.guard_acts = 0  # decisions the guard changed (yields, Fast picks by cache kept, aged picks), at select
        self._n_fair = 0
        self._chosen = (-1, FAST, False)  # (slot, lane, whether the guard yielded) of the last select()
        self._ahead_pick = -1  # the last select()'s pick when it went ahead of the Fair pick
        self._alt_for, self._alt = -1, None  # this select()'s Fast alternative, for the Fair pick _alt_for
        self.aheads = 0  # admissions that went ahead of the Fair lane's pick (fast_ahead)
        # lost context (lost_blocks, with sticky_due): recently evicted block hashes, or with
        # lost_scope="turns" the ends of admitted prompts; and whether this queue records evictions
        # (a group's queues share one memory, evictions recorded by one of them: share_evicted)
        self.evicted = EvictedBlocks(base.lost_blocks) if base.lost_blocks and base.sticky_due else None
        self._lost_evicted = base.lost_scope == "evicted"  # else: prompt ends (lost_scope="turns")
        self._records_evictions = self._lost_evicted  # until another queue's memory is shared
        self.lost_credits = 0  # requests whose deadline counted a lost prefix as cached

    # -- columns ---------------------------------------------------------------------------

    def _grow_extra(self, n: int) -> None:
        self.promoted = grow_column(self.promoted, n)
        self.promoted_at = grow_column(self.promoted_at, n)
        self.due = grow_column(self.due, n)
        self.peak = grow_column(self.peak, n)

    def _due_now(self, slot: int) -> float:
        return self._due_for(slot, float(self.prefill_s[slot]))

    def _due_for(self, slot: int, p: float) -> float:
        """The deadline of ``slot`` with prefill estimate ``p``: arrival + theta * max(P, floor)."""
        return float(self.arrival[slot]) + self.config.theta * max(p, self.config.p_floor_s)

    def share_evicted(self, evicted: EvictedBlocks) -> None:
        """Use another queue's memory of lost context from now on: the per-tenant or per-class
        queues of one replica share one. That queue alone records the evicted blocks; each
        records the ends of the prompts it admits (``lost_scope="turns"``). A queue configured
        without the memory keeps none."""
        if self.evicted is not None:
            self.evicted, self._records_evictions = evicted, False

    def on_blocks_removed(self, hashes: Iterable[int]) -> None:
        """The cache dropped ``hashes``: remember them (``lost_blocks``), then the hit tracking's
        update. O(1) per block for the memory."""
        if self.evicted is not None and self._records_evictions:
            hashes = hashes if isinstance(hashes, (list, tuple)) else list(hashes)
            self.evicted.add(hashes)
        super().on_blocks_removed(hashes)

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        self.promoted[slot] = False
        self.due[slot] = self._due_now(slot)
        self.peak[slot] = self.cached[slot]
        if self.evicted:
            self._credit_lost(slot, req)

    def _credit_lost(self, slot: int, req: QueuedRequest) -> None:
        """Pull ``slot``'s deadline in to what it would be had this replica kept the prefix it
        computed and evicted (``lost_blocks``): the prompt's blocks past its hit while each is
        cached or remembered as evicted, or with ``lost_scope="turns"`` up to the deepest block
        that ended a prompt admitted here. O(blocks past the hit)."""
        tracker = self._tracker
        if tracker is None:  # no cache view: nothing was ever cached here to lose
            return
        lost = self.evicted
        hashes = self._cacheable(req)
        hit = int(self.cached[slot]) // self.block_size
        k = hit
        if self._lost_evicted:
            contains = tracker.contains
            for h in hashes[hit:]:
                if h in lost or contains(h):
                    k += 1
                else:
                    break
        else:
            k = lost.deepest(hashes, hit)  # type: ignore[union-attr]
        if k == hit:
            return
        c = k * self.block_size
        p = self.cost.prefill_time(int(self.prompt[slot]) - c, c)
        self.due[slot] = min(float(self.due[slot]), self._due_for(slot, p))
        self.lost_credits += 1

    def _on_hit_change(self, rid: int, old: int, new: int) -> None:
        super()._on_hit_change(rid, old, new)
        slot = self._slot_of[rid]
        if self.cached[slot] > self.peak[slot]:
            self.peak[slot] = self.cached[slot]
        if self.config.sticky_due:
            # the deadline only moves earlier: eviction while waiting is not the request's doing
            self.due[slot] = min(float(self.due[slot]), self._due_now(slot))
        else:
            self.due[slot] = self._due_now(slot)

    def _on_hit_cut(self, rid: int, old: int, path: list[int]) -> None:
        """``_on_hit_change`` for each step of ``path``, folded: the columns take the last
        step's values, and a sticky deadline the earliest of the steps'. Since the deadline is
        non-decreasing in P (so is its float rounding), the earliest is the one at the smallest
        P along the path. O(len(path)) scalar prefill estimates, no numpy access per step."""
        slot = self._slot_of[rid]
        self._set_cached(slot, path[-1])
        cfg = self.config
        if not cfg.sticky_due:
            self.due[slot] = self._due_now(slot)
            return
        p = float(self.prefill_s[slot])
        if len(path) > 1:
            prompt, bs, prefill_time = int(self.prompt[slot]), self.block_size, self.cost.prefill_time
            p = min(p, min(prefill_time(prompt - c, c) for c in map(bs.__mul__, path[:-1])))
        self.due[slot] = min(float(self.due[slot]), self._due_for(slot, p))

    def _on_remove(self, slot: int) -> None:
        if self.promoted[slot]:
            self._n_fair -= 1
            self.promoted[slot] = False

    def _lane_of(self, slot: int) -> tuple[str, bool]:
        """The lane that admits ``slot``: the one whose pick it was (a promoted request can be
        the Fast lane's pick when ``fast_scope="all"``), else its own lane."""
        p = bool(self.promoted[slot])
        chosen, lane, _ = self._chosen
        if chosen == slot:
            return lane, p
        return (FAIR if p else FAST), p

    def lane_sizes(self) -> dict[str, int]:
        return {FAST: len(self) - self._n_fair, FAIR: self._n_fair}

    def may_hold_first_step(self, rid: int) -> bool:
        """With ``first_step_hold``: while ``rid`` is unpromoted and has waited less than its
        prefill time P. O(1)."""
        if not self.config.first_step_hold:
            return False
        slot = self._slot_of[rid]
        return bool(not self.promoted[slot] and self.clock.now() - self.arrival[slot] < self.prefill_s[slot])

    # -- decisions -------------------------------------------------------------------------

    def _effective_p(self) -> np.ndarray:
        return np.maximum(self.prefill_s[: self._hi], self.config.p_floor_s)

    def refresh_lanes(self) -> int:
        """Promote every waiting request whose wait reached theta * max(P, floor); return how
        many were promoted now. O(n) vectorised."""
        hi = self._hi
        now = self.clock.now()
        due = self.due[:hi]
        newly = self.active[:hi] & ~self.promoted[:hi] & (now >= due)
        k = int(np.count_nonzero(newly))
        if k:
            self.promoted[:hi] |= newly
            self.promoted_at[:hi][newly] = due[newly]
            self.promotions += k
            self._n_fair += k
        return k

    def _pick_lane(self) -> str:
        n_fair = self._n_fair
        n_fast = len(self) if self.config.fast_scope == "all" else len(self) - n_fair
        for lane, n, other in ((FAST, n_fast, FAIR), (FAIR, n_fair, FAST)):
            if n and not self._nonempty[lane]:
                self.passes[lane] = self.passes[other]  # restart: bank no credit
            self._nonempty[lane] = n > 0
        if not n_fair:
            return FAST
        if not n_fast:
            return FAIR
        return FAIR if self.passes[FAIR] <= self.passes[FAST] else FAST

    def wants_memory_view(self) -> bool:
        return self.config.memory_guard

    def memory_horizon_s(self) -> float:
        return self.config.guard_horizon_s if self.config.memory_guard else 0.0

    def attach_memory(self, view: KVMemoryView) -> None:
        super().attach_memory(view)
        self._need_memory()

    def _need_memory(self) -> None:
        """Tell the memory view whether the guard may act: its counts are needed from the moment
        ``guard_loss``'s share reaches its threshold (always with 0) and dropped once the share
        falls below half of it (so a share hovering at the threshold does not recount each
        time). O(1) but for the change."""
        cfg, view = self.config, self._memory
        if view is None or not cfg.memory_guard:
            return
        if self._losing():
            view.need(self, True)
        elif self._lost < 0.5 * cfg.guard_loss * self._prefilled:
            view.need(self, False)

    def _losing(self) -> bool:
        """Whether at least ``guard_loss`` of the recently admitted prefill was context lost while
        waiting (always with 0). O(1)."""
        return self._lost >= self.config.guard_loss * self._prefilled

    def _choose(self, now: float) -> int:
        self.refresh_lanes()
        self._alt_for = -1  # no Fast alternative worked out yet in this select()
        lane = self._pick_lane()
        slot = self._choose_in(lane, now)
        ahead = False
        if lane == FAIR and self.config.fast_ahead > 0.0:
            slot, lane = self._ahead(slot, now)
            ahead = lane == FAST
        pick, lane = self._guard(slot, lane, now) if self._guarding() else (slot, lane)
        self.guard_acts += pick != slot
        self._chosen = (pick, lane, pick != slot)
        self._ahead_pick = pick if ahead and pick == slot else -1
        return pick

    def _ahead(self, slot: int, now: float) -> tuple[int, str]:
        """``fast_ahead``: the Fair lane's pick ``slot`` or, ahead of it, the Fast lane's pick
        when that one's prefill is at most ``fast_ahead`` of the Fair pick's and the Fast lane,
        charged for it, stays within one Fair quantum (the Fair pick's prefill over its share)
        of the Fair lane's pass: stride scheduling's own lag bound, so the lanes' shares hold
        and only the order within a quantum changes. O(n) for the Fast lane's pick."""
        alt = self._fast_alternative(slot, now)
        if alt is None:
            return slot, FAIR
        p_fair, p_fast = float(self.prefill_s[slot]), float(self.prefill_s[alt])
        if p_fast > self.config.fast_ahead * p_fair:
            return slot, FAIR
        if self.passes[FAST] + p_fast / self.shares[FAST] > self.passes[FAIR] + p_fair / self.shares[FAIR]:
            return slot, FAIR
        return alt, FAST

    def _aged_pick(self, now: float) -> int:
        """The memory guard's pick with ``guard_aging``: the most cached tokens plus
        ``guard_aging`` per second past the deadline, over the whole queue. Why: longest prefix
        first keeps the sessions in memory, and the aging bounds how long an overdue request
        whose admission evicts can be passed over. O(n) vectorised."""
        hi = self._hi
        late = np.maximum(0.0, now - self.due[:hi])
        return self._argmin(-(self.cached[:hi] + self.config.guard_aging * late), self.active[:hi])

    def _guarding(self) -> bool:
        """Whether the memory guard is on now: configured, with the host's memory view, and at
        least ``guard_overdue`` of the waiting requests promoted (sustained overload). O(1)."""
        cfg = self.config
        return (self._memory is not None and cfg.memory_guard
                and self._n_fair >= cfg.guard_overdue * len(self) and self._losing())

    def _destroys(self, slot: int) -> bool:
        """Whether admitting ``slot`` now evicts more cached context of waiting requests (its new
        blocks beyond the spare ones) than it saves of its own (hit blocks no running request
        holds, which its waiting puts at risk). Needs the memory view. O(hit blocks)."""
        over = self._new_blocks(slot) - self._memory.spare_blocks()  # type: ignore[union-attr]
        return over > 0 and over > self._at_risk(slot)

    def _guard(self, slot: int, lane: str, now: float) -> tuple[int, str]:
        """The memory guard, while it acts, on the lanes' pick ``slot`` (of ``lane``): the pick
        and its lane, unchanged unless admitting it would evict more cached context of waiting
        requests than it saves of its own (``_destroys``). Then, with ``guard_aging``, the aged
        pick (``_aged_pick``), on the account of its own lane; without, a Fair-lane pick yields
        to the Fast lane's pick when that one does not evict. O(n) only when ``slot`` evicts."""
        if self.config.guard_aging > 0:
            if not self._destroys(slot):
                return slot, lane
            alt = self._aged_pick(now)
            return alt, (FAIR if self.promoted[alt] else FAST)
        if lane != FAIR or not self._destroys(slot):
            return slot, lane
        alt = self._fast_alternative(slot, now)
        if alt is None or self._destroys(alt):
            return slot, FAIR
        return alt, FAST

    def _fast_alternative(self, slot: int, now: float) -> int | None:
        """The Fast lane's pick as the alternative to the Fair lane's pick ``slot`` (for the
        memory guard and ``fast_ahead``), or None when the Fast lane offers no other request.
        Worked out once per select(): ``fast_ahead`` and the guard ask for the same one, and the
        Fast lane's choice counts its own guard act. O(n), then O(1)."""
        if self._alt_for == slot:
            return self._alt
        alt: int | None = None
        if self.config.fast_scope == "all" or len(self) != self._n_fair:
            alt = self._choose_in(FAST, now)
            alt = None if alt == slot else alt
        self._alt_for, self._alt = slot, alt
        return alt

    def _choose_in(self, lane: str, now: float) -> int:
        hi = self._hi
        live = self.active[:hi]
        cfg = self.config
        if lane == FAST:
            mask = live if cfg.fast_scope == "all" else live & ~self.promoted[:hi]
            if cfg.fast_order == "least-work":
                slot = self._argmin(self.prefill_s[:hi], mask)
                if not self._guarding() or not self._destroys(slot):
                    return slot
                # memory binds: reuse is the cache a choice keeps, not the work it leaves
                kept = self._argmin(-self.cached[:hi].astype(float), mask)
                self.guard_acts += kept != slot
                return kept
            return self._argmin(-self.cached[:hi].astype(float), mask)
        mask = live & self.promoted[:hi]
        if cfg.fair_order == "ratio":
            return self._argmin(-(now - self.arrival[:hi]) / self._effective_p(), mask)
        return self._argmin(self.due[:hi], mask)

    def _on_admit(self, slot: int, adm: Admission) -> None:
        chosen, _, yielded = self._chosen
        self.yields += yielded and chosen == slot
        self._chosen = (-1, FAST, False)
        self.aheads += self._ahead_pick == slot
        self._ahead_pick = -1
        if self.evicted is not None and not self._lost_evicted:  # lost_scope="turns": its prompt's end
            req = self._items[adm.rid]
            n = self._n_cacheable(req)
            if n:
                self.evicted.add((req.block_hashes[n - 1],))
        lane = adm.lane
        self.passes[lane] += adm.est_prefill_s / self.shares[lane]
        if self.config.memory_guard:  # guard_loss's decayed shares (about the last 100 admissions)
            self._lost = LOSS_DECAY * self._lost + int(self.peak[slot]) - adm.cached_tokens
            self._prefilled = LOSS_DECAY * self._prefilled + adm.prompt_tokens - adm.cached_tokens
            self._need_memory()
