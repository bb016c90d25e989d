"""Cluster routing in the simulator: router instances that pick a replica for each arrival.

``ClusterRouter`` drives router instances as the Ray Serve request router does: each a
``RoutingHost`` (``fairway/routing/host.py``: a router policy, a prefix index and a load view)
under the core's ledger (``fairway/routing/bookings.py`` ``Bookings``), which books each decision,
moves it where it was sent, and adopts the other routers' events of a shared view. With
``routers=K`` it runs K instances, each seeing the requests with ``rid % K == k`` (Ray Serve runs
one router per ingress replica, and its proxies spread requests over them); with the ``own`` view
each builds its index and load view from its own decisions only.

Lifecycle, as the engines report it (``EngineModel.listener``), to the ledger of the instance
that routed the request (a shared view with a delay: to the others' ledgers ``sync_delay_s``
later, the routing and the end as the live view's events):
- routed: the index records the prompt's blocks on the chosen replica (approximate mode), the
  load view adds the request's estimated prefill time to that replica's queued work;
- admitted: the work leaves the queue; preempted: it is queued again;
- first token: a policy that reads tokens held until the first token (``llmd``, ``dynamo``)
  releases the request's prefill tokens (the others' load views do not hear of it, so their
  decisions are unchanged);
- finished (or rejected by the engine): the load view forgets it, the index is corrected with
  the cached-token count the engine reported (approximate mode, finished requests only), and the
  replica's KV usage reaches every instance;
- KV events (stored / removed hashes) reach every instance's index in ``"events"`` mode, and so
  do the tier events of engines with a host KV tier (which hashes are host-only), with the same
  delay and right after the KV events of the same flush.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.engine.model import EngineListener, EngineModel, EngineRequest
from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig
from fairway.prefix_index import APPROX, EVENTS, PrefixIndex
from fairway.request import RequestSpec
from fairway.routing import make_router
from fairway.routing.bookings import REMOTE, Bookings
from fairway.routing.host import RoutingHost
from fairway.summary import pct
from sim.flow import FlowControl
from sim.hit_bounds import References

OWN = "own"  # each router instance learns only from its own decisions (Ray Serve today)
SHARED = "shared"  # every instance sees every instance's decisions, after sync_delay_s
VIEWS = (OWN, SHARED)
#: The router's prefix index: ``approx`` (its decisions, corrected by the engines' cached-token
#: reports, the prompts in flight pinned: ``PrefixIndex`` ``pin_in_flight``), ``lru`` (the same
#: with one LRU over the prompts in flight and finished: the approx index until 2026-12-06),
#: ``decisions`` (its decisions only, as most originals know them) or ``events`` (exact).
LRU = "lru"
DECISIONS = "decisions"
INDEX_MODES = (APPROX, LRU, DECISIONS, EVENTS)


class ClusterRouter(EngineListener):
    """K router instances over N replicas; callable as the simulator's ``Router``."""

    def __init__(
        self,
        name: str,
        n_replicas: int,
        clock: Clock,
        cost: CostModel,
        *,
        block_size: int = 16,
        seed: int = 0,
        routers: int = 1,
        index_mode: str = "approx",
        capacity_blocks: int | None = None,
        stale_s: float = 0.0,
        options: dict[str, Any] | None = None,
        view: str = OWN,
        sync_delay_s: float = 0.0,
        flow: FlowControl | None = None,
        classes: ClassesConfig | None = None,
    ) -> None:
        """``classes``: the request classes the replicas order by, for a router policy that
        prices a request on its class's queue (``RoutingHost``); None: the whole queue."""
        if routers < 1:
            raise ValueError("routers must be >= 1")
        if index_mode not in INDEX_MODES:
            raise ValueError(f"unknown index mode {index_mode!r}; known: {', '.join(INDEX_MODES)}")
        if view not in VIEWS:
            raise ValueError(f"unknown router view {view!r}; known: {', '.join(VIEWS)}")
        if sync_delay_s < 0:
            raise ValueError("sync_delay_s must be >= 0")
        self.name = name
        self.flow = flow  # request classes: the wait-bound check (sim/flow.py), None without classes
        self.block_size = block_size
        self.index_mode = index_mode
        feedback = index_mode != DECISIONS
        pin = index_mode == APPROX  # without feedback nothing would ever leave flight
        index_mode = APPROX if index_mode in (LRU, DECISIONS) else index_mode
        self.view = view
        self.clock = clock
        self.sync_delay_s = sync_delay_s if view == SHARED else 0.0
        rngs = np.random.default_rng(seed).spawn(routers)

        def index() -> PrefixIndex:
            return PrefixIndex(n_replicas, mode=index_mode, capacity_blocks=capacity_blocks, pin_in_flight=pin)

        def load() -> LoadView:
            return LoadView(n_replicas, clock, cost, block_size=block_size, stale_s=stale_s)

        one = view == SHARED and self.sync_delay_s == 0.0  # one index and load view for all
        shared_index, shared_load = (index(), load()) if one else (None, None)
        self.instances = [
            RoutingHost(
                make_router(name, clock=clock, cost=cost, block_size=block_size, rng=rngs[k],
                            **(options or {})),
                shared_index if one else index(),
                shared_load if one else load(),
                block_size=block_size,
                feedback=feedback,
                classes=classes,
            )
            for k in range(routers)
        ]
        self._indexes = [shared_index] if one else [i.index for i in self.instances]
        self._loads = [shared_load] if one else [i.load for i in self.instances]
        names = [str(j) for j in range(n_replicas)]
        rids = itertools.count() if one else None  # one load view: one set of request ids
        self.ledgers = [Bookings(host, clock, clock.now, source=f"router{k}", known=names, rids=rids)
                        for k, host in enumerate(self.instances)]
        # shared view with a delay: what one instance learns reaches the others sync_delay_s later
        self._inbox: list[deque[tuple[float, Callable[[Bookings], None]]]] = [deque() for _ in self.instances]
        self.engines: list[EngineModel] = []
        # request id -> (the decision's reason, its expected first-token time on the replica it was
        # sent to: ``Booking.expected_ttft_s``), for the policies that predict one (``model_ratios``)
        self.expected: dict[int, tuple[str, float]] = {}

    def bind(self, engines: Sequence[EngineModel]) -> None:
        """Attach to the engines so their lifecycle reports reach the instances."""
        self.engines = list(engines)
        for j, e in enumerate(engines):
            e.listener = self
            for load in self._loads:
                load.report_max_running(j, e.config.max_num_seqs)

    def _ledger(self, rid: int) -> Bookings:
        return self.ledgers[rid % len(self.ledgers)]

    def _post(self, rid: int, update: Callable[[Bookings], None]) -> None:
        """Shared view with a delay: apply ``update`` to every instance but ``rid``'s own, once
        ``sync_delay_s`` has passed. O(K)."""
        if self.sync_delay_s <= 0.0:
            return
        due = self.clock.now() + self.sync_delay_s
        own = rid % len(self.instances)
        for k, box in enumerate(self._inbox):
            if k != own:
                box.append((due, update))

    def deliver_all(self) -> None:
        """Apply every update still on its way (the end of a run: the views settle)."""
        for box, ledger in zip(self._inbox, self.ledgers, strict=True):
            while box:
                box.popleft()[1](ledger)

    def _deliver(self, k: int) -> None:
        """Apply the updates that have reached instance ``k`` by now, in the order sent."""
        box, now = self._inbox[k], self.clock.now()
        ledger = self.ledgers[k]
        while box and box[0][0] <= now:
            box.popleft()[1](ledger)

    def _prompt_hashes(self, spec: RequestSpec) -> Sequence[int]:
        return spec.block_hashes[: spec.prompt_tokens // self.block_size]

    # -- routing -----------------------------------------------------------------------------

    def __call__(self, spec: RequestSpec, replicas: list[EngineModel], held: bool = False) -> int:
        """The replica for ``spec``; with flow control -1 (refused) or ``HELD``. ``held``: a held
        request the held queue offers now: a replica with room, or -1 (none has room)."""
        ledger = self._ledger(spec.rid)
        if self.sync_delay_s > 0.0:
            self._deliver(spec.rid % len(self.instances))
        hashes = self._prompt_hashes(spec)
        key = str(spec.rid)
        d, _ = ledger.choose(key, key, spec.prompt_tokens, hashes,
                             session=str(spec.session) if spec.session >= 0 else None, klass=spec.priority_class)
        pick = d.pick
        if self.flow is not None:
            ranked = [j for tier in d.ranks for j in tier if j != d.pick]
            order = [d.pick, *ranked, *(j for j in range(len(replicas)) if j != d.pick and j not in ranked)]
            # a held request goes to the router's pick or waits (as the live ingress's probe)
            pick = (self.flow.first_with_room(spec, replicas, order[:1]) if held
                    else self.flow.place(spec, replicas, order))
            if pick < 0:
                ledger.unbook(key)  # refused or held: not sent
                return pick
        if self.flow is not None:
            self.flow.placed(spec, pick)
        b = ledger.sent(key, pick, key, spec.prompt_tokens, hashes, spec.priority_class).booking
        assert b is not None
        if b.expected_ttft_s > 0.0 and not held:
            self.expected[spec.rid] = (b.reason, b.expected_ttft_s)
        if self.sync_delay_s > 0.0:
            event = ledger.routed_event(b)
            self._post(spec.rid, lambda lg: lg.apply_remote(event))
        elif self.view == SHARED:  # one index and load view: only the policies' own statistics
            for other in self.instances:
                if other is not ledger.host:
                    other.policy.on_adopted(hashes, b.best_blocks, spec.prompt_tokens)
        return pick

    @property
    def reads_engines(self) -> bool:
        """Whether a decision reads the engines' state (flow control's room checks); without
        it the router learns only from the engines' reports, so the simulator may take plain
        decode steps in bulk (sim/simulator.py)."""
        return self.flow is not None

    @property
    def holds(self) -> bool:
        """Whether this router may hold requests (flow control with a held queue; it also sheds
        requests past their class's bound at ``release``)."""
        return self.flow is not None and self.flow.held is not None

    @property
    def pending(self) -> bool:
        """Whether ``release`` has anything to do: requests held, or placed with a bound to watch."""
        return self.flow is not None and self.flow.pending

    @property
    def n_held(self) -> int:
        """Requests the router holds (flow control's held queue)."""
        return 0 if self.flow is None else self.flow.n_held

    def release(self, replicas: list[EngineModel]) -> tuple[list[tuple[RequestSpec, int]], list[RequestSpec]]:
        """The held requests placed now (each routed anew, booked) and those whose hold ended
        (``FlowControl.release``)."""
        assert self.flow is not None
        return self.flow.release(lambda spec: self(spec, replicas, held=True), replicas)

    # -- engine reports (EngineModel.listener) ----------------------------------------------

    def _report(self, rid: int, apply: Callable[[Bookings, str], None]) -> None:
        """``apply(ledger, key)`` to request ``rid``'s booking: now in its own instance's ledger,
        and, in a shared view with a delay, ``sync_delay_s`` later in the others' under the key
        they adopted it by. O(1) plus ``apply``."""
        ledger, key = self._ledger(rid), str(rid)
        b = ledger.get(key)
        if self.sync_delay_s > 0.0 and b is not None:
            remote = REMOTE + ledger.shared_key(b)
            self._post(rid, lambda lg: apply(lg, remote))
        apply(ledger, key)

    def on_admitted(self, replica: int, r: EngineRequest) -> None:
        at = self.clock.now()
        self._report(r.rid, lambda lg, key: lg.started(key, started_at=at))

    def on_first_token(self, replica: int, r: EngineRequest) -> None:
        self._report(r.rid, Bookings.first_token)

    def on_preempted(self, replica: int, r: EngineRequest) -> None:
        target = r.target
        self._report(r.rid, lambda lg, key: lg.preempted(key, target))

    def on_finished(self, replica: int, r: EngineRequest) -> None:
        ledger, key, cached = self._ledger(r.rid), str(r.rid), r.cached_tokens
        b = ledger.complete(key, replica).booking
        ledger.report_cached(key, replica, cached)
        if self.sync_delay_s > 0.0 and b is not None:
            event = ledger.finished_event(b)

            def finished(lg: Bookings) -> None:
                lg.apply_remote(event)
                lg.report_cached(key, replica, cached)

            self._post(r.rid, finished)
        if self.engines:
            usage = self.engines[replica].pool.usage()
            for load in self._loads:
                load.report_kv_usage(replica, min(1.0, max(0.0, usage)))

    @property
    def hears_kv_events(self) -> bool:
        """Only the exact view reads the engines' KV events."""
        return self.index_mode == EVENTS

    def on_kv_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        """Events mode: the engine's stored / removed blocks reach every instance's index, after
        ``sync_delay_s`` in a shared view with a delay (a replica's events travel through the
        shared view as the routers' do)."""
        self._to_indexes(PrefixIndex.on_kv_events, replica, events)

    def on_kv_tier_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        """Events mode, engines with a host tier: which hashes became / stopped being host-only
        (``BlockPool.tier_events``) reach every index as the KV events do, queued after them."""
        self._to_indexes(PrefixIndex.on_tier_events, replica, events)

    def _to_indexes(self, apply: Callable[[PrefixIndex, int, Sequence[tuple[bool, int]]], None], replica: int,
                    events: Sequence[tuple[bool, int]]) -> None:
        """``apply(index, replica, events)`` on every instance's index (events mode only): now, or
        after ``sync_delay_s`` through the instances' inboxes, in the order the engine sent them."""
        if self.index_mode != "events":
            return
        if self.sync_delay_s > 0.0:
            batch = tuple(events)
            item = (self.clock.now() + self.sync_delay_s, lambda lg: apply(lg.host.index, replica, batch))
            for box in self._inbox:
                box.append(item)
            return
        for index in self._indexes:
            apply(index, replica, events)

    def model_ratios(self, ttft_s: dict[int, float]) -> dict[str, dict[str, float]]:
        """How far the router's expected first-token times were off, by decision reason: the
        requests' TTFT (``ttft_s``, by request id; each routed at its arrival) over what the
        policy expected on the replica it chose, as the live ingress exports it
        (``fairway_router_ttft_model_ratio``), as ``fairway.summary.pct``. Empty for a policy that
        predicts none. O(n log n)."""
        by: dict[str, list[float]] = {}
        for rid, (reason, expected) in self.expected.items():
            t = ttft_s.get(rid)
            if t is not None:
                by.setdefault(reason, []).append(t / expected)
        return {reason: pct(xs) for reason, xs in sorted(by.items())}

    def reasons(self) -> dict[str, int]:
        total: Counter = Counter()
        for i in self.instances:
            total.update(i.reasons)
        return dict(sorted(total.items()))


def ceiling_hit_ratio(specs: Sequence[RequestSpec], capacity_blocks: int, block_size: int,
                      refs: References | None = None) -> float:
    """Hit ratio of one shared LRU prefix cache with the cluster's total capacity, replaying the
    requests in arrival order (each request's prompt is looked up, then its prompt and output
    blocks are inserted, then the least recently used blocks are dropped down to the capacity).
    It ignores concurrency and memory held by running requests, so it is an upper reference for
    what routing can reach, not an achievable figure.

    How, without a linked list per block: after each request the cache holds the
    ``capacity_blocks`` distinct blocks referenced most recently, so a block is cached iff its
    last reference lies at or after a threshold position ``t`` of the flattened reference
    stream (``refs``: ``References.of(specs, block_size)`` if already built). ``t`` only moves
    forward; per request, a few array operations over its blocks look its prompt up, move its
    blocks' last references, and advance ``t`` past the references that fell out. O(B log B)
    for building ``refs``, then O(B) array work in all."""
    if refs is None:
        refs = References.of(specs, block_size)
    ids = refs.ids
    last = np.full(len(refs.count), -1, dtype=np.int64)  # block id -> its last reference so far
    is_last = np.zeros(len(ids), dtype=bool)  # reference i is its block's last so far
    t = 0  # cached iff last reference >= t
    live = 0  # references >= t that are their block's last: the cached blocks
    cached = 0
    for s, n, nc in zip(refs.starts.tolist(), refs.lens.tolist(), refs.cacheable.tolist(), strict=True):
        x = ids[s : s + n]
        prev = last[x]
        if nc:
            present = prev[:nc] >= t
            cached += len(present) if present.all() else int(present.argmin())
        if not n:
            continue
        pos = np.arange(s, s + n)
        last[x] = pos
        mine = last[x] == pos
        old = prev[prev >= 0]
        if int(np.count_nonzero(mine)) < n:  # a block twice in one request: its later reference is its last
            for i in range(s, s + n):
                last[ids[i]] = i
            mine = last[x] == pos
            old = np.unique(old)
        is_last[old] = False
        live -= int(np.count_nonzero(old >= t))
        is_last[s : s + n] = mine
        k = int(np.count_nonzero(mine))
        live += k
        excess = live - capacity_blocks
        while excess > 0:  # drop the oldest cached blocks: move t past `excess` live references
            w = max(4 * excess, 4096)
            window = np.flatnonzero(is_last[t : t + w])
            if len(window) >= excess:
                t += int(window[excess - 1]) + 1
                live -= excess
                break
            t += w
            live -= len(window)
            excess -= len(window)
    prompt = refs.prompt_tokens
    return cached * block_size / prompt if prompt else 0.0
