"""Fairway's replica choice inside Ray Serve: a ``RequestRouter`` subclass.

Ray Serve runs one request router per deployment handle, i.e. one per ingress replica. This one
calls the same ``RoutingHost`` (``fairway/routing/host.py``) as the simulator's ``ClusterRouter``:
a router policy (``fairway`` or any anchor, by name or dotted path), a prefix index and a load
view:

- ``choose_replicas`` reads the ``GenerateCall`` the ingress passed (token count and chained
  block hashes), matches it against the index, builds the ``ReplicaState`` list for the live
  candidates and returns the policy's ranks (Ray then picks the shortest queue within a rank);
- ``on_request_routed``: the index records the prompt's blocks on the chosen replica, the load
  view adds its estimated prefill time to that replica's queued work;
- ``on_request_completed``: the request leaves the load view; so does a booking Ray will never
  report, because its caller left (a client that hung up) before the request was sent;
- the replicas' periodic ``record_routing_stats`` (``fairway/protocol.py:ReplicaRoutingStats``)
  bring KV usage and capacity, the requests still waiting in each gate (the others routed before
  the report have started: their work leaves the queued figure) and the cached tokens each
  finished request got, which corrects the index (feedback mode).

This class only adapts Ray's callbacks and the replicas' stats to the core's host, so the decision
is the one the simulator measures. Complexity per decision: O(prompt blocks) index match +
O(replicas) states + the policy's rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fairway.clock import Clock, MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.load_view import LoadView
from fairway.prefix_index import PrefixIndex
from fairway.protocol import GenerateCall
from fairway.routing import make_router
from fairway.routing.fallback_index import FallbackIndex
from fairway.routing.host import RoutingHost
from fairway.routing.view_log import DEFAULT_SYNC_PERIOD_S, REPLICA_SOURCE, Exchange

logger = logging.getLogger("ray.serve")
MAX_AWAITING_FEEDBACK = 4096  # finished requests kept until their cached-token report arrives
MAX_TRACKED = 65536  # outstanding requests tracked per router
SPEED_RANGE = (0.05, 20.0)  # a replica's reported drain rate is clamped into this before it is used
#: A request Ray assigned a replica but did not send within this long is taken as never sent: its
#: caller was cancelled between the assignment and the send, and Ray reports neither (see
#: ``FairwayRequestRouter._unbook_if_unsent``). An accepted send reports within milliseconds.
UNSENT_GRACE_S = 5.0


@dataclass(slots=True)
class _Routed:
    rid: int
    request_id: str
    replica: int
    hashes: tuple[int, ...]
    estimated_blocks: int
    prompt_tokens: int
    routed_at: float  # wall clock, to compare with a replica's stats time
    started: bool = False
    sent: bool = False  # on_request_routed seen (Ray sent it and the replica accepted it)
    reason: str = "choice"
    remote: bool = False  # routed by another router (shared view): no metrics here
    best_blocks: int = 0  # the decision's longest match among the candidates (the policy's statistics)


def find_call(pending: PendingRequest | None) -> GenerateCall | None:
    """The ``GenerateCall`` among a pending request's arguments, if any. O(args)."""
    if pending is None:
        return None
    for a in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(a, GenerateCall):
            return a
    return None


class FairwayRequestRouter(RequestRouter):
    """Ray Serve request router hosting a ``fairway.routing`` policy (see the module docstring).

    ``request_router_kwargs`` (built by ``cluster/config.py``): ``policy`` (default "fairway"),
    ``policy_options`` (dict), ``profile`` (cost profile), ``block_size`` (16), ``seed``,
    ``metrics``, ``shared_view`` (share routing with the application's other request routers
    through ``router/view_hub.py``), ``sync_period_s`` and ``prefix_view``: ``"approx"`` (the
    index learns from the routings and the engines' cached-token reports) or ``"events"`` (the
    replicas' exact KV events through the hub, with the approximate index as the fallback while
    they are not current: ``fairway/routing/fallback_index.py``). Tests inject ``clock`` (the load
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
        exchange: Callable[[str, list, int, bool], Awaitable[Exchange]] | None = None,
        unsent_grace_s: float = UNSENT_GRACE_S,
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
            FallbackIndex(0) if self.exact else PrefixIndex(0),
            LoadView(0, self.clock, self.cost, block_size=block_size),
            block_size=block_size,
        )
        self.policy, self.index, self.load = self.host.policy, self.host.index, self.host.load
        self.reasons = self.host.reasons
        self._ids: dict[str, int] = {}  # replica unique id -> index in the host
        self._names: list[str] = []
        self._routed: OrderedDict[str, _Routed] = OrderedDict()  # internal_request_id -> record
        self._done: OrderedDict[str, _Routed] = OrderedDict()  # finished, awaiting feedback
        self._seen_stats: dict[int, float] = {}
        self._next_rid = 0
        self.decision_s: list[float] = []
        self.stats = None
        self.exporter = None
        if metrics:
            self._start_metrics()
        # shared view (router/view_hub.py): events out, the other routers' events in
        self.shared_view = shared_view or self.exact
        self.sync_period_s = sync_period_s
        self.router_id = uuid.uuid4().hex[:12]
        self._exchange = exchange
        self._connects = exchange is None  # this router finds the hub itself (not injected)
        self._outbox: list[tuple] = []
        self._seq = 0  # the last hub seq applied
        self._synced = False
        self._sync_task: asyncio.Task | None = None
        self.view_degraded = False
        self.view_gaps = 0
        self._need_snapshot = self.exact  # the replicas' block sets, before the exact view is used
        self.kv_hashes_applied = 0

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

    # -- replica ids -------------------------------------------------------------------------

    def _index_of(self, rid: ReplicaID) -> int:
        return self._slot(rid.unique_id)

    def _slot(self, uid: str) -> int:
        j = self._ids.get(uid)
        if j is None:
            j = self.host.add_replica()
            self._ids[uid] = j
            self._names.append(uid)
        return j

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        j = self._ids.get(replica_id.unique_id)
        if j is not None:
            self.index.clear_replica(j)

    # -- stats from the replicas ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray calls this with the running replicas whenever their set or their routing stats
        change (the controller broadcasts every ``request_routing_stats_period_s``). The stats
        are applied here too, not only at the next decision, so the load view, the index's
        feedback and the cached-token counters are current within one stats period of a request
        finishing, whether or not more requests come. O(replicas + tracked requests)."""
        super().update_replicas(replicas)
        for rep in replicas:
            stats = rep.routing_stats
            if stats:
                self._apply_stats(self._index_of(rep.replica_id), stats)

    def _apply_stats(self, j: int, stats: dict[str, Any]) -> None:
        taken = float(stats.get("taken_at", 0.0))
        if not taken or self._seen_stats.get(j) == taken:
            return
        self._seen_stats[j] = taken
        total = int(stats.get("kv_blocks_total", 0))
        if total > 0:
            self.index.set_capacity(j, total)
        self.load.report_max_running(j, max(0, int(stats.get("max_num_seqs", 0))))
        usage = float(stats.get("kv_usage", 0.0))
        self.load.report_kv_usage(j, min(1.0, max(0.0, usage)))
        self.load.report_speed(j, min(SPEED_RANGE[1], max(SPEED_RANGE[0], float(stats.get("drain_rate", 1.0)))))
        waiting = set(stats.get("waiting_ids", ()))
        # Wall times from the replica, on the load view's clock. A request missing from the
        # waiting list started before ``taken``: at its admission time if the replica lists it
        # as prefilling, else (an older replica) at ``taken`` at the latest. One that started
        # and is not prefilling has its first token: its prefill no longer delays anyone.
        wall_to_clock = self.clock.now() - self.wall()
        started_by = wall_to_clock + taken
        prefilling = stats.get("prefilling")
        in_engine = stats.get("admitted_ids")
        # a request in none of the replica's lists had not reached it at ``taken`` (still in
        # transit from this router): it stays queued, or a burst would look already served
        seen = None if in_engine is None else set(in_engine) | set(stats.get("recent_cached", ()))
        for r in self._routed.values():
            if r.replica != j or r.routed_at >= taken or r.request_id in waiting or r.rid not in self.load:
                continue
            if seen is not None and r.request_id not in seen:
                continue
            admitted = prefilling.get(r.request_id) if prefilling is not None else None
            if not r.started:
                r.started = True
                self.host.on_started(r.rid, started_at=started_by if admitted is None else wall_to_clock + admitted)
            if prefilling is not None and admitted is None:
                self.load.on_prefill_done(r.rid)
        for request_id, got in stats.get("recent_cached", {}).items():
            r = self._done.pop(request_id, None)
            if r is not None and r.replica == j:
                self._feedback(r, int(got))
        self._publish(j)

    def _feedback(self, r: _Routed, cached: int) -> None:
        self.host.feedback(r.replica, r.hashes, cached, r.estimated_blocks)
        if self.stats is not None and not r.remote:
            self.stats.observe_cached_tokens(r.estimated_blocks * self.block_size, cached, r.prompt_tokens,
                                             replica=self._names[r.replica])

    # -- the decision --------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        t0 = time.perf_counter()
        by_idx: dict[int, RunningReplica] = {}
        stalled, full = [], []
        for rep in candidate_replicas:
            j = self._index_of(rep.replica_id)
            by_idx[j] = rep
            stats = rep.routing_stats
            if stats:
                self._apply_stats(j, stats)
                if stats.get("stalled"):
                    stalled.append(j)
                elif stats.get("full"):
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
        if self.shared_view:
            await self._ensure_synced()
        n_hash = len(call.prompt_token_ids) // self.block_size
        hashes = tuple(call.block_hashes[:n_hash])
        iid = pending_request.metadata.internal_request_id
        self._unbook(iid)  # a retry of the same request: forget its previous provisional booking
        d = self.host.decide(self._next_rid, len(call.prompt_token_ids), hashes, replicas=sorted(by_idx),
                             session=call.session or None)
        # Book the expected pick now: Ray routes requests concurrently, and a burst that all sees
        # the same load would herd onto one replica before the first on_request_routed.
        booked = self._book(iid, call, hashes, d.pick, d.matched_blocks, d.reason, d.best_blocks)
        # A caller that goes away before Ray assigns a replica (a client that hung up) gets no
        # on_request_routed and no on_request_completed: its booking must not stay queued.
        pending_request.future.add_done_callback(lambda f: self._unbook_if_unsent(iid, booked, f))
        ranks = d.ranks
        self.decision_s.append(time.perf_counter() - t0)
        if len(self.decision_s) > 4096:
            del self.decision_s[:2048]
        return [[by_idx[j] for j in rank if j in by_idx] for rank in ranks]

    def _book(self, iid: str, call: GenerateCall, hashes: tuple[int, ...], j: int, est: int,
              reason: str, best: int = 0) -> _Routed:
        rid = self._next_rid
        self._next_rid += 1
        n = len(call.prompt_token_ids)
        self.host.book(rid, j, n, est, hashes)
        r = _Routed(rid, call.request_id, j, hashes, est, n, self.wall(), reason=reason, best_blocks=max(best, est))
        self._track(iid, r)
        self._publish(j)
        return r

    def _track(self, key: str, r: _Routed) -> None:
        """Keep ``r`` until it completes; beyond MAX_TRACKED the oldest (ranked or learnt, but
        never completed) is forgotten."""
        self._routed[key] = r
        while len(self._routed) > MAX_TRACKED:
            _, old = self._routed.popitem(last=False)
            self._drop(old)

    def _unbook(self, iid: str) -> None:
        r = self._routed.pop(iid, None)
        if r is not None:
            self._drop(r)

    def _drop(self, r: _Routed) -> None:
        """Forget a booking that will never complete here (not sent, evicted, its router gone)."""
        self.host.unbook(r.rid)
        self._publish(r.replica)

    def _unbook_if_unsent(self, iid: str, booked: _Routed, future: asyncio.Future) -> None:
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

    def _unbook_unsent(self, iid: str, booked: _Routed) -> None:
        if self._routed.get(iid) is booked and not booked.sent:
            self._unbook(iid)

    def _publish(self, j: int) -> None:
        """Replica j's gauges: what this router counts there (outstanding, queued prefill). O(1)."""
        if self.stats is not None:
            out, queued_s = self.load.replica_load(j)
            self.stats.set_router_load(self._names[j], out, queued_s)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = find_call(pending_request)
        if call is None:
            return
        j = self._index_of(replica_id)
        iid = pending_request.metadata.internal_request_id
        r = self._routed.get(iid)
        if r is None or r.replica != j:  # Ray picked another replica of the rank than booked
            n_hash = len(call.prompt_token_ids) // self.block_size
            hashes = tuple(call.block_hashes[:n_hash])
            reason = r.reason if r is not None else "choice"
            best = r.best_blocks if r is not None else 0
            self._unbook(iid)
            r = self._book(iid, call, hashes, j, self.index.match_one(j, hashes), reason, best)
        r.routed_at = self.wall()
        r.sent = True
        self.host.record_routed(j, r.hashes, r.reason)
        if self.shared_view:
            self._outbox.append(("r", self._names[j], f"{self.router_id}:{r.rid}", r.hashes, r.prompt_tokens,
                                 r.estimated_blocks, r.request_id, r.routed_at, r.best_blocks))
        if self.stats is not None:
            self.stats.inc_routing_decision(r.reason, replica=self._names[j])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        r = self._routed.get(internal_request_id)
        if r is None or self._ids.get(replica_id.unique_id) != r.replica:
            return  # not booked, or an earlier attempt on another replica (refused, then routed again)
        del self._routed[internal_request_id]
        if self.shared_view:
            self._outbox.append(("f", f"{self.router_id}:{r.rid}"))
        self._finished(r)

    def _finished(self, r: _Routed) -> None:
        self.host.on_finished(r.rid)
        self._publish(r.replica)
        self._done[r.request_id] = r
        while len(self._done) > MAX_AWAITING_FEEDBACK:
            _, old = self._done.popitem(last=False)
            self.host.release(old.replica, old.hashes)

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
            await asyncio.sleep(backoff)
            ok = await self.sync_once()
            backoff = self.sync_period_s if ok else min(1.0, backoff * 2)

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
            host = ex.host or {}
            for uid, hashes in ex.kv.items():
                self.index.replace_blocks(self._slot(uid), hashes, host.get(uid, ()))
            self._need_snapshot = False
        elif ex.gap and self.exact:  # KV events were lost: exact again after the next snapshot
            self._need_snapshot = True
        for event in ex.events:
            self._apply_remote(event)
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

    def _apply_remote(self, event: tuple) -> None:
        """An event from the shared view: another router's "r" (a request routed: its prompt on
        that replica, its work queued there), "f" (it finished: it leaves the load view and
        awaits its feedback); a replica's "kv" (blocks stored and removed), "tier" (blocks that
        became / stopped being host-only: engines with a host KV tier, applied after the "kv" of
        the same batch) or "kv-full" (its whole block set, and its host-only set when it has
        one); or "gone" (a router stopped exchanging: its requests in flight leave
        the load view; a replica stopped publishing: its blocks are no longer known)."""
        kind = event[0]
        if kind == "kv":
            if self.exact:
                _, uid, stored, removed = event
                self.index.on_kv_events(self._slot(uid), _as_events(stored, removed))
                self.kv_hashes_applied += len(stored) + len(removed)
        elif kind == "tier":
            if self.exact:
                _, uid, host_only, back = event
                self.index.on_tier_events(self._slot(uid), _as_events(host_only, back))
                self.kv_hashes_applied += len(host_only) + len(back)
        elif kind == "kv-full":
            if self.exact:
                host = event[3] if len(event) > 3 else ()  # 3 fields without a host tier
                self.index.replace_blocks(self._slot(event[1]), event[2], host)
                self.kv_hashes_applied += len(event[2]) + len(host)
        elif kind == "r":
            _, uid, key, hashes, prompt_tokens, est, request_id, routed_at, *more = event
            best = more[0] if more else est  # a router of the previous release sends no best match
            if "remote:" + key in self._routed:  # a batch sent twice (its first exchange timed out)
                return
            j = self._slot(uid)
            rid = self._next_rid
            self._next_rid += 1
            self.host.adopt(rid, j, hashes, prompt_tokens, est, best)
            self._track("remote:" + key, _Routed(rid, request_id, j, tuple(hashes), est, prompt_tokens, routed_at,
                                                 remote=True))
            self._publish(j)
        elif kind == "f":
            r = self._routed.pop("remote:" + event[1], None)
            if r is not None:
                self._finished(r)
        elif kind == "gone" and event[1].startswith(REPLICA_SOURCE):
            j = self._ids.get(event[1][len(REPLICA_SOURCE):])
            if self.exact and j is not None:
                self.index.replace_blocks(j, ())
        elif kind == "gone" and event[1] != self.router_id:  # a router died: drop what it had in flight
            prefix = f"remote:{event[1]}:"
            for key in [k for k in self._routed if k.startswith(prefix)]:
                self._drop(self._routed.pop(key))


def _as_events(on: list[int], off: list[int]) -> Iterator[tuple[bool, int]]:
    """A replica's batch, ("kv", uid, stored, removed) or ("tier", uid, host_only, back), as the
    index's (flag, hash) events: the False ones first (a batch holds one event per hash, so the
    order only matters across hashes, where it does not). O(1) each."""
    for h in off:
        yield False, h
    for h in on:
        yield True, h
