"""Fairway's replica choice inside Ray Serve: a ``RequestRouter`` subclass.

Ray Serve runs one request router per deployment handle, i.e. one per ingress replica. This one
calls the same ``RoutingHost`` (``fairway/routing/host.py``) as the simulator's ``ClusterRouter``:
a router policy (``fairway`` or any anchor, by name or dotted path), a prefix index and a load
view, with the core's ledger (``fairway/routing/bookings.py``) keeping the requests booked and
reconciling them with the replicas' reports and the other routers' events:

- ``choose_replicas`` reads the ``GenerateCall`` the ingress passed (token count and chained
  block hashes) and lets the ledger decide among the live candidates and book the pick; it
  returns the policy's ranks (Ray then picks the shortest queue within a rank);
- ``on_request_routed`` / ``on_request_completed`` and the end of a request's future (a caller
  that left before the send) reach the ledger;
- the replicas' periodic ``record_routing_stats`` (``fairway/protocol.py:ReplicaRoutingStats``),
  applied on every stats broadcast (``update_replicas``) and before each decision;
- the shared view (``router/view_hub.py``): this router's events out, the others' into the ledger.

This class is the glue: Ray's callbacks, the metrics (it publishes the replicas whose load the
ledger reports changed, and its cached-token reports) and the hub exchange loop. Complexity per
decision: O(prompt blocks) index match + O(replicas) states + the policy's rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fairway.clock import Clock, MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig, ClassSpec
from fairway.prefix_index import PrefixIndex
from fairway.protocol import ChannelCall, GenerateCall, ReplicaRoutingStats
from fairway.routing import make_router
from fairway.routing.bookings import MAX_TRACKED, Booking, Bookings, Changes
from fairway.routing.fallback_index import FallbackIndex
from fairway.routing.host import RoutingHost
from fairway.routing.view_log import DEFAULT_SYNC_PERIOD_S, Event, Exchange, RequestFinished, RequestRouted

logger = logging.getLogger("ray.serve")
#: A request Ray assigned a replica but did not send within this long is taken as never sent: its
#: caller was cancelled between the assignment and the send, and Ray reports neither (see
#: ``FairwayRequestRouter._unbook_if_unsent``). An accepted send reports within milliseconds.
UNSENT_GRACE_S = 5.0
#: How often an idle router exchanges with the shared view (seconds): one with nothing in flight,
#: nothing to send and no decision or completion for this long. The hub announces a router
#: silent for 3 s gone, so 1 s keeps it known; with other routers, the next decision has the loop
#: exchange at once and routes after it.
IDLE_SYNC_PERIOD_S = 1.0
#: How long a decision after an idle period waits for that exchange before it routes anyway.
CATCH_UP_WAIT_S = 0.25
#: A router that has seen no other router's event for this long routes alone: after an idle
#: period it does not wait for an exchange (nothing but its own requests changes the caches).
PEER_WINDOW_S = 30.0


def find_call(pending: PendingRequest | None) -> GenerateCall | None:
    """The ``GenerateCall`` among a pending request's arguments, if any. O(args)."""
    if pending is None:
        return None
    for a in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(a, GenerateCall):
            return a
    return None


def find_channel(pending: PendingRequest | None) -> ChannelCall | None:
    """The ``ChannelCall`` among a pending request's arguments (an ingress opening its stream
    channel to one replica, ``replicas/channel.py``), if any. O(args)."""
    if pending is None:
        return None
    for a in pending.args:
        if isinstance(a, ChannelCall):
            return a
    return None


def routing_stats(rep: RunningReplica) -> ReplicaRoutingStats | None:
    """A replica's routing stats as Ray holds them: the dataclass the replica returned, or None
    (Ray's ``{}`` until the replica's first report)."""
    stats = rep.routing_stats
    return stats if isinstance(stats, ReplicaRoutingStats) else None


class FairwayRequestRouter(RequestRouter):
    """Ray Serve request router hosting a ``fairway.routing`` policy (see the module docstring).

    ``request_router_kwargs`` (built by ``cluster/config.py``): ``policy`` (default "fairway"),
    ``policy_options`` (dict), ``profile`` (cost profile), ``block_size`` (16), ``seed``,
    ``metrics``, ``shared_view`` (share routing with the application's other request routers
    through ``router/view_hub.py``), ``sync_period_s`` and ``prefix_view``: ``"approx"`` (the
    index learns from the routings and the engines' cached-token reports) or ``"events"`` (the
    replicas' exact KV events through the hub, with the approximate index as the fallback while
    they are not current: ``fairway/routing/fallback_index.py``); ``classes`` (the request classes
    the gates order by, as ``ClassSpec`` fields, JSON) and ``default_class``, so a policy with a
    class view prices a request on its class's queue. Tests inject ``clock`` (the load
    view's time, default monotonic), ``wall`` (the time base of the replicas' stats stamps,
    default ``time.time``), ``exchange`` (the hub call) and ``unsent_grace_s``.
    """

    def initialize_state(
        self,
        policy: str = "fairway",
        policy_options: dict[str, Any] | None = None,
        profile: str = DEFAULT_PROFILE,
        block_size: int = 16,
        seed: int = 0,
        metrics: bool = True,
        shared_view: bool = False,
        sync_period_s: float = DEFAULT_SYNC_PERIOD_S,
        prefix_view: str = "approx",
        clock: Clock | None = None,
        wall: Callable[[], float] | None = None,
        exchange: Callable[[str, list[Event], int, bool], Awaitable[Exchange]] | None = None,
        unsent_grace_s: float = UNSENT_GRACE_S,
        idle_sync_period_s: float = IDLE_SYNC_PERIOD_S,
        classes: list[dict[str, Any]] | None = None,
        default_class: str = "",
        **unused: Any,
    ) -> None:
        if unused:
            raise TypeError(f"FairwayRequestRouter got unknown options: {', '.join(sorted(unused))}")
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.wall = wall if wall is not None else time.time
        self.cost = CostModel.from_profile(profile)
        self.block_size = block_size
        self.unsent_grace_s = unsent_grace_s
        self.policy_name = policy
        if prefix_view not in ("approx", "events"):
            raise ValueError(f"unknown prefix_view {prefix_view!r}; known: approx, events")
        self.exact = prefix_view == "events"  # the replicas' KV events come through the shared view
        self.host = RoutingHost(
            make_router(policy, clock=self.clock, cost=self.cost, block_size=block_size,
                        rng=np.random.default_rng(seed), **(policy_options or {})),
            FallbackIndex(0) if self.exact else PrefixIndex(0, pin_in_flight=True),
            LoadView(0, self.clock, self.cost, block_size=block_size),
            block_size=block_size,
            classes=ClassesConfig(tuple(ClassSpec(**c) for c in classes or ()), default_class),
        )
        self.policy, self.index, self.load = self.host.policy, self.host.index, self.host.load
        self.reasons = self.host.reasons
        self.router_id = uuid.uuid4().hex[:12]
        self.bookings = Bookings(self.host, self.clock, self.wall, source=self.router_id, exact=self.exact)
        self.decision_s: list[float] = []
        self._expired_logged = False  # bookings a replica's report showed ended unheard (logged once)
        self.stats = None
        self.exporter = None
        if metrics:
            self._start_metrics()
        # shared view (router/view_hub.py): events out, the other routers' events in
        self.shared_view = shared_view or self.exact
        self.sync_period_s = sync_period_s
        self.idle_sync_period_s = max(idle_sync_period_s, sync_period_s)
        self._last_active = -float("inf")  # clock time of this router's last decision or completion
        self._wake = asyncio.Event()  # set by a decision while the exchange loop waits at the idle period
        self._idle_wait = False
        self._caught_up: asyncio.Future | None = None  # the exchange woken decisions wait for
        self._peer_at = -float("inf")  # clock time of the last other router's event applied
        self._exchange = exchange
        self._connects = exchange is None  # this router finds the hub itself (not injected)
        self._outbox: list[Event] = []
        self._seq = 0  # the last hub seq applied
        self._synced = False
        self._sync_task: asyncio.Task | None = None
        self.view_degraded = False
        self.view_gaps = 0
        self._need_snapshot = self.exact  # the replicas' block sets, before the exact view is used

    def _start_metrics(self) -> None:
        from observability.exporter import MetricsExporter
        from observability.stats import FairwayStats

        name = f"router-{uuid.uuid4().hex[:8]}"
        self.stats = FairwayStats(level="router", component=name, policy=self.policy_name)
        try:
            self.exporter = MetricsExporter([self.stats], component=name, level="router")
            self.exporter.start()
        except Exception as e:  # noqa: BLE001 - routing must not depend on metrics
            logger.warning("fairway router: metrics endpoint not started: %s", e)

    @property
    def kv_hashes_applied(self) -> int:
        """Hashes of the replicas' KV events applied to the exact view."""
        return self.bookings.kv_hashes_applied

    def _index_of(self, rid: ReplicaID) -> int:
        return self.bookings.replica(rid.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        try:
            self.bookings.replica_died(replica_id.unique_id)
        except Exception:  # noqa: BLE001 - Ray calls this while it routes a request: a raise here leaves it pending
            logger.exception("fairway router %s: forgetting dead replica %s failed", self.router_id,
                             replica_id.unique_id)

    def _publish(self, changes: Changes) -> None:
        """The replicas' gauges (what this router counts there: outstanding, queued prefill) and
        the cached-token counters, for what a ledger call changed. O(changes)."""
        if self.stats is None:
            return
        names = self.bookings.names
        for j in changes.replicas:
            out, queued_s = self.load.replica_load(j)
            self.stats.set_router_load(names[j], out, queued_s)
        for c in changes.cached:
            self.stats.observe_cached_tokens(c.estimated_tokens, c.cached_tokens, c.prompt_tokens,
                                             replica=names[c.replica])

    # -- stats from the replicas ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray calls this with the running replicas whenever their set or their routing stats
        change (the controller broadcasts every ``request_routing_stats_period_s``). The stats
        are applied here too, not only at the next decision, so the load view, the index's
        feedback and the cached-token counters are current within one stats period of a request
        finishing, whether or not more requests come. O(replicas + tracked requests)."""
        super().update_replicas(replicas)
        for rep in replicas:
            stats = routing_stats(rep)
            if stats is not None:
                self._apply_stats(self._index_of(rep.replica_id), stats)

    def _apply_stats(self, j: int, stats: ReplicaRoutingStats) -> None:
        """Replica ``j``'s report into the ledger, its gauges published; the bookings it showed
        ended unheard are counted and logged (once per router: a lost completion is a bug)."""
        changes = self.bookings.apply_stats(j, stats)
        self._publish(changes)
        if changes.expired:
            if self.stats is not None:
                self.stats.inc_bookings_expired(changes.expired, replica=self.bookings.names[j])
            if not self._expired_logged:
                self._expired_logged = True
                logger.warning("fairway router %s: %d request(s) counted on replica %s had ended unheard; "
                               "no longer counted (fairway_router_bookings_expired_total)", self.router_id,
                               changes.expired, self.bookings.names[j])

    # -- the decision --------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pin = find_channel(pending_request)
        if pin is not None:  # to its replica, whatever its load; gone: any (which ends it at once)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin.replica] or candidate_replicas]
        t0 = time.perf_counter()
        by_idx: dict[int, RunningReplica] = {}
        stalled, full = [], []
        for rep in candidate_replicas:
            j = self._index_of(rep.replica_id)
            by_idx[j] = rep
            stats = routing_stats(rep)
            if stats is not None:
                self._apply_stats(j, stats)
                if stats.stalled:
                    stalled.append(j)
                elif stats.full:
                    full.append(j)
        # avoid stalled engines while another replica is up, then queues at their wait bound
        # (they would answer 429) while another replica has room
        for avoid in (stalled, full):
            if avoid and len(avoid) < len(by_idx):
                for j in avoid:
                    del by_idx[j]
                candidate_replicas = list(by_idx.values())
        call = find_call(pending_request)
        if call is None:  # not a generation call (health, models): any replica
            return [candidate_replicas]
        if call.avoid:  # a retry of a request these replicas refused: elsewhere, while one is left
            kept = {j: rep for j, rep in by_idx.items() if rep.replica_id.unique_id not in call.avoid}
            if kept:
                by_idx = kept
        if self.shared_view:
            await self._ensure_synced()
            self._last_active = now = self.clock.now()
            if self._idle_wait and now - self._peer_at < PEER_WINDOW_S:
                await self._catch_up()  # other routers route: exchange now, and route after it
        n_hash = len(call.prompt_token_ids) // self.block_size
        iid = pending_request.metadata.internal_request_id
        # The ledger books the expected pick now: Ray routes requests concurrently, and a burst
        # that all sees the same load would herd onto one replica before the first
        # on_request_routed. A retry of the same request replaces its previous booking.
        d, changes = self.bookings.choose(iid, call.request_id, len(call.prompt_token_ids),
                                          call.block_hashes[:n_hash], sorted(by_idx), session=call.session or None,
                                          klass=call.priority_class)
        self._publish(changes)
        booked = changes.booking
        # A caller that goes away before Ray assigns a replica (a client that hung up) gets no
        # on_request_routed and no on_request_completed: its booking must not stay queued.
        pending_request.future.add_done_callback(lambda f: self._unbook_if_unsent(iid, booked, f))
        self.decision_s.append(time.perf_counter() - t0)
        if len(self.decision_s) > 4096:
            del self.decision_s[:2048]
        return [[by_idx[j] for j in rank if j in by_idx] for rank in d.ranks]

    def _unbook_if_unsent(self, iid: str, booked: Booking, future: asyncio.Future) -> None:
        """The done callback of the pending request's future. Ray reports neither routing nor
        completion for a request whose caller left (a client that hung up) before it was sent:

        - cancelled: the caller left before Ray assigned a replica; the booking goes now;
        - a replica: Ray sends the request at once unless the caller was cancelled in the same
          instant; the booking goes if it is still unsent ``unsent_grace_s`` later.

        Either way only if no later choice for the same request (a retry) replaced it. O(1)."""
        if future.cancelled():
            self._unbook_unsent(iid, booked)
        else:
            future.get_loop().call_later(self.unsent_grace_s, self._unbook_unsent, iid, booked)

    def _unbook_unsent(self, iid: str, booked: Booking) -> None:
        self._publish(self.bookings.unbook_unsent(iid, booked))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = find_call(pending_request)
        if call is None:
            return
        j = self._index_of(replica_id)
        n_hash = len(call.prompt_token_ids) // self.block_size
        changes = self.bookings.sent(pending_request.metadata.internal_request_id, j, call.request_id,
                                     len(call.prompt_token_ids), call.block_hashes[:n_hash], call.priority_class)
        self._publish(changes)
        b = changes.booking
        assert b is not None
        # what the ingress compares with the first token's time (ReplicaStream.first)
        call.expected_ttft_s = b.expected_ttft_s
        call.routing_reason = b.reason
        if self.shared_view:
            self._outbox.append(self.bookings.routed_event(b))
            if changes.ended:  # its completion came first (see Bookings.complete): end it there too
                self._outbox.append(self.bookings.finished_event(b))
        if self.stats is not None:
            self.stats.inc_routing_decision(b.reason, replica=self.bookings.names[j])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        changes = self.bookings.complete(internal_request_id, self.bookings.index_of(replica_id.unique_id))
        if changes.booking is None:
            return  # not booked, or an earlier attempt on another replica (refused, then routed again)
        if self.shared_view and changes.booking.sent:  # unsent: the others never saw it routed
            self._outbox.append(self.bookings.finished_event(changes.booking))
            self._last_active = self.clock.now()  # the engine's KV events for it come after
        self._publish(changes)

    # -- the shared view (router/view_hub.py) ---------------------------------------------------

    async def _ensure_synced(self) -> None:
        """Before the first decision, read what the other routers routed (bootstrap); then keep
        a background task exchanging every ``sync_period_s``."""
        if self._sync_task is None:
            if not self._synced:
                await self.sync_once(timeout_s=2.0)
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        backoff = self.sync_period_s
        while True:
            wait = self.sync_wait_s(backoff)
            self._idle_wait = wait > backoff
            if self._idle_wait:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
                self._idle_wait = False
            else:
                await asyncio.sleep(wait)
            ok = await self.sync_once()
            caught_up, self._caught_up = self._caught_up, None
            if caught_up is not None and not caught_up.done():
                caught_up.set_result(ok)
            backoff = self.sync_period_s if ok else min(1.0, backoff * 2)

    async def _catch_up(self) -> None:
        """A decision after an idle period: wake the exchange loop and wait for its exchange (at
        most ``CATCH_UP_WAIT_S``), so the decision sees what the other routers and the replicas
        did meanwhile. Concurrent decisions share the one exchange; the loop stays the only
        caller of ``sync_once``. About one actor round trip, once per idle period."""
        if self._caught_up is None:
            self._caught_up = asyncio.get_running_loop().create_future()
            self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._caught_up), CATCH_UP_WAIT_S)
        except TimeoutError:
            pass  # route on the view as it is; the exchange still lands

    def sync_wait_s(self, backoff: float) -> float:
        """How long the exchange loop waits before the next exchange: ``backoff`` (the sync
        period, longer after failures) while this router is busy, ``idle_sync_period_s`` while it
        is idle: nothing booked, nothing to send and no decision or completion for that long
        (the replicas' KV events of a finished request come within a KV period). An idle router
        needs no news until its next decision. While other routers have routed within
        ``PEER_WINDOW_S`` that decision has the loop exchange at once and routes after it
        (``_catch_up``); alone, nothing but its own requests changes the replicas' caches, so it
        routes at once and the loop goes on at the busy period when its idle wait ends (an
        exchange on the request's path cost it about a millisecond here). Why: each exchange is
        an actor call, about a millisecond of CPU on each side, 20 a second at the 50 ms period,
        and an idle cluster needs none. O(1)."""
        if (backoff > self.sync_period_s or self._outbox or len(self.bookings)
                or self.clock.now() - self._last_active < self.idle_sync_period_s):
            return backoff
        return self.idle_sync_period_s

    async def sync_once(self, timeout_s: float = 1.0) -> bool:
        """One exchange with the hub: send this router's events, apply the others'. On failure
        the view degrades to this router's own (logged once, counted, the gauge set) and the
        events are kept for the next try; it recovers by itself. O(events)."""
        batch, self._outbox = self._outbox, []
        try:
            if self._exchange is None:
                from router.view_hub import get_hub

                hub = get_hub(getattr(getattr(self, "_deployment_id", None), "app_name", "") or "default")
                self._exchange = hub.exchange.remote
            ex = await asyncio.wait_for(self._exchange(self.router_id, batch, self._seq, self._need_snapshot),
                                        timeout_s)
        except Exception as e:  # noqa: BLE001 - routing goes on with this router's own view
            self._outbox = (batch + self._outbox)[-MAX_TRACKED:]
            if not self.view_degraded:
                logger.warning("fairway router %s: shared view unavailable (%s: %s); routing on its own view",
                               self.router_id, type(e).__name__, e)
            self.view_degraded = True
            self._use_exact(False)
            if self.stats is not None:
                self.stats.inc_view_sync("failed")
                self.stats.set_view_degraded(True)
            if self._connects:  # reconnect next time (the hub may have moved or restarted)
                self._exchange = None
            return False
        if ex.gap:
            self.view_gaps += 1
        self._seq = ex.head
        if ex.kv is not None:  # a snapshot of every replica's blocks, as of before ex.events
            self.bookings.apply_snapshot(ex.kv, ex.host)
            self._need_snapshot = False
        elif ex.gap and self.exact:  # KV events were lost: exact again after the next snapshot
            self._need_snapshot = True
        for event in ex.events:
            if isinstance(event, (RequestRouted, RequestFinished)):
                self._peer_at = self.clock.now()
            self._publish(self.bookings.apply_remote(event))
        self._synced = True
        self._use_exact(not self._need_snapshot)
        if self.view_degraded:
            logger.info("fairway router %s: shared view recovered", self.router_id)
        self.view_degraded = False
        if self.stats is not None:
            self.stats.inc_view_sync("ok")
            self.stats.set_view_degraded(False)
        return True

    def _use_exact(self, on: bool) -> None:
        """Route on the exact prefix view (events mode, events current) or the approximate one."""
        if self.exact:
            if on and self.index.mode != "events":
                logger.info("fairway router %s: exact prefix view (KV events) in use", self.router_id)
            elif not on and self.index.mode == "events":
                logger.warning("fairway router %s: KV events not current; routing on the approximate prefix view",
                               self.router_id)
            self.index.use_exact(on)
            if self.stats is not None:
                self.stats.set_prefix_view_exact(on)
