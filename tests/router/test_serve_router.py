"""The Ray Serve request router (``FairwayRequestRouter``) without a Ray cluster: the object is
built directly on a manual clock and fed what Ray feeds it (replicas, pending requests, the
replicas' ``ReplicaRoutingStats``), so every expectation is exact."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

from fairway.clock import ManualClock
from fairway.protocol import GenerateCall, ReplicaRoutingStats
from fairway.routing import make_states
from fairway.routing.view_log import KvDelta, KvFull, SourceGone, TierDelta
from router.serve_router import FairwayRequestRouter
from tests.factories import chain

T0 = 100.0  # the manual clock's start; the replicas' stats stamps use the same time base


def router(policy: str = "fairway", unsent_grace_s: float = 60.0,
           **options) -> tuple[FairwayRequestRouter, ManualClock]:
    clock = ManualClock(T0)
    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(policy=policy, policy_options=options, metrics=False, clock=clock, wall=clock.now,
                       unsent_grace_s=unsent_grace_s)
    return r, clock


def replica(uid: str, stats: ReplicaRoutingStats | None = None) -> SimpleNamespace:
    """What ``choose_replicas`` reads of a Ray ``RunningReplica`` (Ray holds ``{}`` until the
    replica's first report)."""
    return SimpleNamespace(replica_id=ReplicaID(uid, DeploymentID("FairwayReplica")), routing_stats=stats or {})


def rstats(taken_at: float, kv_usage: float = 0.0, kv_blocks_total: int = 0, **fields) -> ReplicaRoutingStats:
    return ReplicaRoutingStats(taken_at=taken_at, kv_usage=kv_usage, kv_blocks_total=kv_blocks_total, **fields)


def call(request_id: str, prompt: int, family: str | None = None) -> GenerateCall:
    return GenerateCall(request_id=request_id, prompt_token_ids=[1] * prompt,
                        block_hashes=tuple(chain(family or request_id, prompt // 16)), max_tokens=4, arrival_s=T0)


def pending(c: GenerateCall) -> PendingRequest:
    return PendingRequest(args=[c], kwargs={}, metadata=RequestMetadata(request_id=c.request_id,
                                                                          internal_request_id="iid-" + c.request_id))


def book(r: FairwayRequestRouter, j: int, request_id: str, prompt: int, routed_at: float) -> None:
    c = call(request_id, prompt)
    r.bookings.book("iid-" + request_id, request_id, j, prompt, c.block_hashes, 0, "cold", routed_at=routed_at)


def one_replica() -> tuple[FairwayRequestRouter, ManualClock, int]:
    r, clock = router()
    j = r._index_of(replica("replica-0").replica_id)
    return r, clock, j


def test_stats_mark_starts_date_prefills_and_drop_finished_prefills():
    r, clock, j = one_replica()
    for rid in ("a", "b", "c"):  # a: prefilling since T0 - 0.5; b: first token out; c: still waiting
        book(r, j, rid, 20000, routed_at=T0 - 5.0)
    p = r.load.snapshot().queued_prefills[j]
    assert len(p) == 3 and r.load.snapshot().running == (0,)
    pa = p[0]  # the three prompts cost the same
    r.bookings.apply_stats(j, rstats(taken_at=T0 - 0.1, waiting_ids=["c"], prefilling={"a": T0 - 0.5},
                                     kv_usage=0.0, max_num_seqs=256))
    snap = r.load.snapshot()
    assert snap.running == (2,) and snap.queued_prefills[j] == (pa,)
    # "a" is dated from its admission; "b" is past its prefill and does not count
    assert snap.prefill_ends[j] == (T0 - 0.5 + pa,)
    (state,) = make_states(r.load.snapshot(), [0], r.index.sizes())
    assert r.policy.running_prefill_s(state) == pytest.approx(pa - 0.5, rel=1e-12)
    clock.advance(0.25)  # time passes: less of "a"'s prefill is left
    (state,) = make_states(r.load.snapshot(), [0], r.index.sizes())
    assert r.policy.running_prefill_s(state) == pytest.approx(pa - 0.75, rel=1e-12)
    # the same report again changes nothing; the next one: "a" has its first token too
    r.bookings.apply_stats(j, rstats(taken_at=T0 - 0.1, waiting_ids=["c"], prefilling={}, kv_usage=0.0))
    assert r.load.snapshot().prefill_ends[j] == (T0 - 0.5 + pa,)
    r.bookings.apply_stats(j, rstats(taken_at=T0, waiting_ids=["c"], prefilling={}, kv_usage=0.0))
    assert r.load.snapshot().prefill_ends[j] == ()


def test_a_request_the_replica_has_not_seen_yet_stays_queued():
    """Routed before the report but in none of its lists: still in transit to the replica (a
    burst on a busy host). Counting it as past its prefill made a burst look served, and the
    next cold requests herded onto that replica."""
    r, _, j = one_replica()
    for rid in ("a", "b", "done"):
        book(r, j, rid, 20000, routed_at=T0 - 5.0)
    pa = r.load.snapshot().queued_prefills[j][0]
    r.bookings.apply_stats(j, rstats(taken_at=T0 - 0.1, waiting_ids=[], prefilling={"a": T0 - 0.5},
                                     admitted_ids=["a"], recent_cached={"done": 0}, kv_usage=0.0))
    snap = r.load.snapshot()
    # "a" prefilling since its admission; "done" finished (past its prefill); "b" not arrived: queued
    assert snap.running == (2,) and snap.prefill_ends[j] == (T0 - 0.5 + pa,)
    assert snap.queued_prefills[j] == (pa,)
    # without the list (an older replica), "b" is taken as past its prefill, as before
    r2, _, j2 = one_replica()
    book(r2, j2, "b", 20000, routed_at=T0 - 5.0)
    r2.bookings.apply_stats(j2, rstats(taken_at=T0 - 0.1, waiting_ids=[], prefilling={}, kv_usage=0.0))
    assert r2.load.snapshot().running == (1,) and r2.load.snapshot().queued_prefills[j2] == ()


def test_a_request_routed_after_the_report_is_not_started_by_it():
    r, _, j = one_replica()
    book(r, j, "late", 20000, routed_at=T0 - 0.05)
    r.bookings.apply_stats(j, rstats(taken_at=T0 - 0.1, waiting_ids=[], prefilling={}, kv_usage=0.0))
    assert r.load.snapshot().running == (0,) and len(r.load.snapshot().queued_prefills[j]) == 1


@pytest.mark.asyncio
async def test_the_routed_call_carries_the_expected_first_token_time_of_the_replica_it_went_to():
    """The Fairway router's expected time to the first token on the replica Ray sent the call to,
    and the decision's reason, go back to the ingress on the call (``ReplicaStream.first`` compares
    them with the first token's time). On an idle replica it is the cold prompt's first step;
    sent to the other replica of the rank, behind a started 20,000-token prefill, that
    replica's longer one. A router that predicts none leaves 0."""
    r, _ = router("fairway")
    reps = [replica("replica-0"), replica("replica-1")]
    busy = r._index_of(reps[1].replica_id)
    book(r, busy, "running", 20000, routed_at=T0 - 1.0)
    r.bookings.apply_stats(busy, rstats(taken_at=T0 - 0.5, prefilling={"running": T0 - 0.5}, max_num_seqs=256))
    c = call("a", 4096)
    ranks = await r.choose_replicas(reps, pending(c))
    assert [rep.replica_id.unique_id for rank in ranks for rep in rank] == ["replica-0", "replica-1"]
    step = r.cost.step_time(4096, 0, 4096 * 4096, 0, 0)  # idle: its one step, no decodes beside it
    r.on_request_routed(pending(c), reps[0].replica_id, None)
    assert c.expected_ttft_s == pytest.approx(step) and c.routing_reason == "cold"
    d = call("b", 4096)
    await r.choose_replicas(reps, pending(d))
    r.on_request_routed(pending(d), reps[1].replica_id, None)  # the pick refused it: the next rank's
    # behind what is left of the running prefill (started 0.5 s ago; 3 steps of at most the
    # engine's 8,192 tokens), then its own step beside one decode
    left = r.cost.chunked_prefill_time(20000, 0, 8192) - 0.5
    assert d.expected_ttft_s == pytest.approx(left + step, abs=0.002) and left > 0.3
    assert d.routing_reason == r.bookings.get("iid-b").reason
    p, _ = router("pow2")
    e = call("e", 4096)
    await p.choose_replicas(reps, pending(e))
    p.on_request_routed(pending(e), reps[0].replica_id, None)
    assert e.expected_ttft_s == 0.0 and e.routing_reason == p.bookings.get("iid-e").reason


@pytest.mark.asyncio
async def test_choose_replicas_follows_the_prefix_and_books_the_pick():
    r, _ = router("ray-prefix")
    reps = [replica("replica-0"), replica("replica-1")]
    first = call("a", 4096, family="doc")
    ranks = await r.choose_replicas(reps, pending(first))
    pick = ranks[0][0]
    r.on_request_routed(pending(first), pick.replica_id, None)
    j = r.bookings.index_of(pick.replica_id.unique_id)
    assert r.index.match(first.block_hashes[:256])[j] == 256 and r.reasons == {r.bookings.get("iid-a").reason: 1}
    # a second request of the same family goes to the replica that holds its prefix
    second = call("b", 4096, family="doc")
    ranks = await r.choose_replicas(reps, pending(second))
    assert ranks[0] == [pick]
    assert r.bookings.get("iid-b").replica == j and r.bookings.get("iid-b").estimated_blocks == 256
    # completion: the request leaves the load view and waits for its cached-token feedback
    r.on_request_completed(pick.replica_id, "iid-a")
    assert "iid-a" not in r.bookings and r.bookings.awaiting_feedback("a") and 0 not in r.load


@pytest.mark.asyncio
async def test_a_classed_call_is_booked_under_its_class_with_the_clusters_classes():
    """The cluster hands the router its classes as JSON (Ray's rule for router kwargs); the
    router rebuilds them, and a call's class (the default class for one that names none)
    queues its booking in that class's queue of the load view."""
    from cluster.config import ClusterArgs

    kwargs = ClusterArgs(classes=[{"name": "interactive", "tier": 0}, {"name": "batch", "tier": 1}]).router_kwargs()
    json.dumps(kwargs)
    clock = ManualClock(T0)
    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(**{**kwargs, "metrics": False}, clock=clock, wall=clock.now)
    reps = [replica("replica-0"), replica("replica-1")]
    for rid, klass in (("a", "interactive"), ("b", "")):
        c = call(rid, 64)
        c.priority_class = klass
        pick = (await r.choose_replicas(reps, pending(c)))[0][0]
        r.on_request_routed(pending(c), pick.replica_id, None)
    assert r.bookings.get("iid-a").klass == "interactive" and r.bookings.get("iid-b").klass == ""
    assert r.view_degraded  # outside a Ray cluster the shared view's hub is refused, not started
    queued = {k for q in r.load.snapshot().class_queues for k in q}
    assert queued == {"interactive", "batch"}  # "": the default class, the last configured


def test_a_failure_to_forget_a_dead_replica_is_logged_not_raised_into_rays_routing(monkeypatch, caplog):
    # Ray calls on_replica_actor_died from the loop that assigns a pending request a replica: a
    # raise there left that request pending until its client gave up (60 s)
    r, _ = router()
    monkeypatch.setattr(RequestRouter, "on_replica_actor_died", lambda self, rid: None)  # Ray's own bookkeeping

    def broken(uid: str) -> None:
        raise KeyError(uid)

    monkeypatch.setattr(r.bookings, "replica_died", broken)
    r.on_replica_actor_died(ReplicaID("replica-0", DeploymentID("FairwayReplica")))
    assert "forgetting dead replica replica-0 failed" in caplog.text


def test_replica_updates_apply_stats_without_another_decision(monkeypatch):
    """Ray calls ``update_replicas`` on every stats broadcast. The finished request's cached-token
    report is taken in then, not at the next decision, so the counters do not lag when no request
    follows."""
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)  # Ray's own bookkeeping
    r, _, j = one_replica()
    book(r, j, "a", 4096, routed_at=T0 - 5.0)
    r.bookings.get("iid-a").sent = True
    r.on_request_completed(replica("replica-0").replica_id, "iid-a")
    assert r.bookings.awaiting_feedback("a")
    r.update_replicas([replica("replica-0", rstats(taken_at=T0, waiting_ids=[], prefilling={},
                                                   recent_cached={"a": 1024}, kv_usage=0.25))])
    assert not r.bookings.awaiting_feedback("a")  # its feedback was applied
    assert r.load.snapshot().kv_usage[j] == 0.25
    r.update_replicas([replica("replica-1")])  # a replica without stats yet: nothing to apply
    assert r.bookings.index_of("replica-1") is None


def test_a_booking_a_replica_report_shows_ended_unheard_is_counted_and_logged_once(monkeypatch, caplog):
    """The ledger's reconciliation (``Bookings.apply_stats``) through Ray's stats broadcast: the
    lost completion leaves the gauge, counts in ``fairway_router_bookings_expired_total`` and is
    logged once."""
    from observability.stats import FairwayStats

    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    r, _, j = one_replica()
    r.stats = FairwayStats(level="router", component="test")
    for rid in ("a", "b"):
        book(r, j, rid, 4096, routed_at=T0 - 60.0)
        r.bookings.get("iid-" + rid).sent = True
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        r.update_replicas([replica("replica-0", rstats(taken_at=T0, admitted_ids=["b"]))])
        assert r.load.snapshot().outstanding[j] == 1
        r.update_replicas([replica("replica-0", rstats(taken_at=T0 + 1.0, admitted_ids=[]))])
    assert r.load.snapshot().outstanding[j] == 0 and len(r.bookings) == 0
    assert r.stats.gauge("router_outstanding", replica="replica-0") == 0
    assert r.stats.counter("bookings_expired", replica="replica-0") == 2
    assert sum("ended unheard" in m for m in caplog.messages) == 1


async def settle() -> None:
    """Let the loop run the futures' done callbacks (scheduled with call_soon)."""
    import asyncio

    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_a_request_whose_caller_left_before_its_assignment_leaves_the_load_view():
    """Ray calls neither on_request_routed nor on_request_completed for a pending request that
    its caller cancelled (a client that hung up) between the choice and the assignment. Its
    booking used to stay queued for good, and the next cold burst herded onto the other replica
    (a CI run split 16 prompts 2/14)."""
    from observability.stats import FairwayStats

    r, _ = router()
    r.stats = FairwayStats(level="router", component="test")
    reps = [replica("replica-0"), replica("replica-1")]
    gone, kept = pending(call("gone", 4096)), pending(call("kept", 4096))
    await r.choose_replicas(reps, gone)
    await r.choose_replicas(reps, kept)
    j_gone, j_kept = r.bookings.get("iid-gone").replica, r.bookings.get("iid-kept").replica
    assert j_gone != j_kept and r.load.snapshot().outstanding == (1, 1)
    assert r.stats.gauge("router_outstanding", replica=r.bookings.names[j_gone]) == 1
    gone.future.cancel()
    kept.future.set_result(reps[j_kept])  # assigned: Ray will report it routed, then completed
    await settle()
    assert "iid-gone" not in r.bookings and r.load.snapshot().outstanding[j_gone] == 0
    assert r.load.snapshot().outstanding[j_kept] == 1 and "iid-kept" in r.bookings
    assert r.stats.gauge("router_outstanding", replica=r.bookings.names[j_gone]) == 0
    assert r.stats.gauge("queued_prefill", replica=r.bookings.names[j_gone]) == 0.0
    assert r.stats.gauge("queued_prefill", replica=r.bookings.names[j_kept]) > 0.0
    r.on_request_routed(kept, reps[j_kept].replica_id, None)
    r.on_request_completed(reps[j_kept].replica_id, "iid-kept")
    assert r.load.snapshot().outstanding == (0, 0)
    assert r.stats.gauge("router_outstanding", replica=r.bookings.names[j_kept]) == 0


@pytest.mark.asyncio
async def test_a_request_assigned_but_never_sent_leaves_the_load_view_after_the_grace():
    """A caller cancelled in the instant between Ray's assignment and the send: the future holds
    a replica, yet Ray sends nothing and reports nothing. Seen on a real cluster after 1,000
    hang-ups: two bookings left for good. A request that was sent stays booked."""
    import asyncio

    r, _ = router(unsent_grace_s=0.05)
    reps = [replica("replica-0"), replica("replica-1")]
    unsent, sent = pending(call("unsent", 4096)), pending(call("sent", 4096))
    await r.choose_replicas(reps, unsent)
    await r.choose_replicas(reps, sent)
    j_sent = r.bookings.get("iid-sent").replica
    unsent.future.set_result(reps[r.bookings.get("iid-unsent").replica])
    sent.future.set_result(reps[j_sent])
    r.on_request_routed(sent, reps[j_sent].replica_id, None)
    await settle()
    assert sum(r.load.snapshot().outstanding) == 2  # within the grace both count
    deadline = asyncio.get_running_loop().time() + 5.0
    while "iid-unsent" in r.bookings and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert "iid-unsent" not in r.bookings and "iid-sent" in r.bookings
    assert r.load.snapshot().outstanding[j_sent] == 1 and sum(r.load.snapshot().outstanding) == 1


@pytest.mark.asyncio
async def test_a_retried_choice_is_not_undone_by_the_first_futures_end():
    """A request Ray routes again (its replica refused it) gets a new future and a new booking;
    the end of the first future and the refused attempt's completion leave the new booking
    alone, the cancel of the second future drops it."""
    r, _ = router()
    reps = [replica("replica-0"), replica("replica-1")]
    p = pending(call("a", 4096))
    await r.choose_replicas(reps, p)
    p.future.set_result(reps[0])
    p.reset_future()
    await r.choose_replicas(reps, p)  # the retry: the first booking is replaced
    second = r.bookings.get("iid-a")
    await settle()
    assert r.bookings.get("iid-a") is second and sum(r.load.snapshot().outstanding) == 1
    # the refused attempt's completion (Ray cancels it) names the other replica: ignored
    other = reps[1 - second.replica]
    r.on_request_completed(other.replica_id, "iid-a")
    assert r.bookings.get("iid-a") is second and sum(r.load.snapshot().outstanding) == 1
    p.future.cancel()
    await settle()
    assert "iid-a" not in r.bookings and sum(r.load.snapshot().outstanding) == 0


@pytest.mark.asyncio
async def test_a_call_without_a_generate_call_may_go_anywhere():
    r, _ = router()
    reps = [replica("replica-0"), replica("replica-1")]
    health = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="h", internal_request_id="iid-h"))
    assert await r.choose_replicas(reps, health) == [reps]
    assert await r.choose_replicas([], health) == []
    assert len(r.bookings) == 0


# -- the shared view: two routers (two ingress replicas) over one log ----------------------------


def shared_pair(fail: list[bool] | None = None, prefix_view: str = "approx", hub=None):
    """Two routers over one hub (the actor's class, called directly; its clock is pinned so no
    source is ever announced gone unless a test says so)."""
    from router.view_hub import ViewHub

    hub, clock = hub or ViewHub(), ManualClock(T0)

    async def exchange(source, events, after, snapshot=False):
        if fail and fail[0]:
            raise ConnectionError("hub down")
        return hub.exchange(source, list(events), after, snapshot, now=0.0)

    routers = []
    for _ in range(2):
        r = object.__new__(FairwayRequestRouter)
        r.initialize_state(policy="ray-prefix", metrics=False, clock=clock, wall=clock.now, shared_view=True,
                           exchange=exchange, prefix_view=prefix_view)
        r._sync_task = False  # tests call sync_once themselves; no background task
        routers.append(r)
    return routers, hub


async def route(r: FairwayRequestRouter, reps: list, c: GenerateCall):
    """What Ray does with one request: rank, send to the first choice, report it routed."""
    pick = (await r.choose_replicas(reps, pending(c)))[0][0]
    r.on_request_routed(pending(c), pick.replica_id, None)
    return pick


@pytest.mark.asyncio
async def test_an_idle_router_exchanges_at_the_idle_period_and_a_decision_wakes_it():
    """Busy (a decision or a completion within the idle period, a booking, an event to send, or a
    failing hub's backoff): the sync period. Idle: the idle period. With another router's event
    seen, a decision made meanwhile has the loop exchange at once and routes after that exchange;
    alone it routes at once and the loop keeps its idle wait. A real loop on the wall clock: 1 ms
    sync period, 0.5 s idle period."""
    from router.view_hub import ViewHub

    hub, calls = ViewHub(), []

    async def exchange(source, events, after, snapshot=False):
        calls.append(time.monotonic())
        return hub.exchange(source, list(events), after, snapshot)

    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(policy="ray-prefix", metrics=False, shared_view=True, exchange=exchange,
                       sync_period_s=0.001, idle_sync_period_s=0.5)
    assert r.sync_wait_s(0.001) == 0.5  # never active, nothing booked: idle
    assert r.sync_wait_s(0.004) == 0.004  # a failing hub's backoff is kept
    reps = [replica("replica-0"), replica("replica-1")]
    try:
        pick = await route(r, reps, call("a", 256))  # the bootstrap exchange, then the loop starts
        assert r.sync_wait_s(0.001) == 0.001  # booked (and just decided): busy
        await asyncio.sleep(0.6)  # the decision is older than the idle period; the booking keeps it busy
        assert r.sync_wait_s(0.001) == 0.001
        for peer_seen, rid in ((False, "b"), (True, "c")):
            r.on_request_completed(pick.replica_id, "iid-" + ("a" if rid == "b" else "b"))
            deadline = time.monotonic() + 5
            while r._outbox and time.monotonic() < deadline:  # the completion's event goes out
                await asyncio.sleep(0.001)
            assert r.sync_wait_s(0.001) == 0.001  # nothing booked or to send, but just completed: busy
            n, t_idle = await _until_idle(r, calls)
            await asyncio.sleep(0.2)
            assert len(calls) == n  # idle: no exchange within the idle period
            if peer_seen:
                r._peer_at = r.clock.now()
            t_sent = time.monotonic()
            pick = await route(r, reps, call(rid, 256))
            # with a peer: the decision waited for the exchange; alone: it did not
            assert len(calls) == n + (1 if peer_seen else 0), peer_seen
            deadline = time.monotonic() + 5
            while len(calls) == n and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            if peer_seen:  # woken, not timed out
                assert calls[n] - t_sent < 0.1 < 0.5 - (t_sent - t_idle)
            else:  # the idle wait ran its course
                assert calls[n] - t_idle > 0.4
    finally:
        if r._sync_task:
            r._sync_task.cancel()


async def _until_idle(r: FairwayRequestRouter, calls: list[float]) -> tuple[int, float]:
    """Wait (10 s at most) until the exchange loop waits at the idle period: (exchanges so far, when)."""
    deadline = time.monotonic() + 10
    while not r._idle_wait and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert r._idle_wait
    return len(calls), time.monotonic()


@pytest.mark.asyncio
async def test_a_second_router_sees_the_firsts_routing_and_sends_the_sibling_to_the_holder():
    (a, b), _ = shared_pair()
    reps = [replica("replica-0"), replica("replica-1"), replica("replica-2")]
    first = call("a", 4096, family="doc")
    pick = await route(a, reps, first)
    assert await a.sync_once() and await b.sync_once()
    j = b.bookings.index_of(pick.replica_id.unique_id)
    assert b.index.match(first.block_hashes)[j] == 256 and b.load.live().outstanding[j] == 1
    second = call("b", 4096, family="doc")
    assert (await b.choose_replicas(reps, pending(second)))[0] == [pick]
    # a's request finishes: it leaves b's load view too, and waits there for its cached-token report
    a.on_request_completed(pick.replica_id, "iid-a")
    assert await a.sync_once() and await b.sync_once()
    assert b.load.live().outstanding[j] == 1 and b.bookings.awaiting_feedback("a")  # only b's own "b" is left
    assert b.reasons == {}  # a remote routing is not one of b's decisions (b's own was never routed)


@pytest.mark.asyncio
async def test_a_request_reported_ended_before_routed_counts_nowhere_here_or_on_another_router():
    """Ray's completion callback can run before ``on_request_routed`` (a short request ends while
    Ray awaits the replica's acceptance): neither this router nor, through the shared view, another
    one may keep counting it on its replica."""
    (a, b), _ = shared_pair()
    reps = [replica("replica-0"), replica("replica-1")]
    c = call("a", 4096, family="doc")
    p = pending(c)
    pick = (await a.choose_replicas(reps, p))[0][0]
    a.on_request_completed(pick.replica_id, p.metadata.internal_request_id)
    a.on_request_routed(p, pick.replica_id, None)
    assert [type(e).__name__ for e in a._outbox] == ["RequestRouted", "RequestFinished"]
    assert await a.sync_once() and await b.sync_once()
    j = b.bookings.index_of(pick.replica_id.unique_id)
    assert a.load.live().outstanding == (0, 0) and b.load.live().outstanding[j] == 0
    assert len(a.bookings) == 0 and len(b.bookings) == 0
    assert b.index.match(c.block_hashes)[j] == 256  # the other router still learns where it went


@pytest.mark.asyncio
async def test_a_router_that_starts_late_replays_the_log_before_its_first_decision():
    (a, b), log = shared_pair()
    reps = [replica("replica-0"), replica("replica-1")]
    first = call("a", 4096, family="doc")
    pick = await route(a, reps, first)
    assert await a.sync_once()
    b._sync_task = None  # b's first decision bootstraps from the log
    ranks = await b.choose_replicas(reps, pending(call("b", 4096, family="doc")))
    assert ranks[0] == [pick] and b._synced
    b._sync_task.cancel()


@pytest.mark.asyncio
async def test_an_unreachable_hub_degrades_to_the_own_view_and_recovers():
    fail = [True]
    (a, b), _ = shared_pair(fail)
    reps = [replica("replica-0"), replica("replica-1")]
    c = call("a", 4096, family="doc")
    pick = await route(a, reps, c)
    assert not await a.sync_once() and a.view_degraded and len(a._outbox) == 1  # kept for later
    fail[0] = False
    assert await a.sync_once() and not a.view_degraded and a._outbox == []
    assert await b.sync_once() and b.index.match(c.block_hashes)[b.bookings.index_of(pick.replica_id.unique_id)] == 256


@pytest.mark.asyncio
async def test_the_requests_of_a_router_that_died_leave_the_others_load_view():
    (a, b), _ = shared_pair()
    reps = [replica("replica-0"), replica("replica-1")]
    c = call("a", 4096, family="doc")
    pick = await route(a, reps, c)
    assert await a.sync_once() and await b.sync_once()
    j = b.bookings.index_of(pick.replica_id.unique_id)
    assert b.load.live().outstanding[j] == 1
    b.bookings.apply_remote(SourceGone(a.router_id))  # what the hub says once a stops exchanging
    assert b.load.live().outstanding[j] == 0 and not any(k.startswith("remote:") for k in b.bookings)
    assert b.index.match(c.block_hashes)[j] == 256  # where its prompt went is still known


@pytest.mark.asyncio
async def test_a_replica_that_reports_a_stalled_engine_is_left_out_while_another_is_up():
    r, _ = router()
    stalled = rstats(T0, stalled=True, kv_blocks_total=1000, max_num_seqs=8)
    a, b = replica("a", stalled), replica("b", rstats(T0, kv_blocks_total=1000, max_num_seqs=8))
    ranks = await r.choose_replicas([a, b], pending(call("x", 64)))
    assert [[x.replica_id.unique_id for x in rank] for rank in ranks] == [["b"]]
    alone = await r.choose_replicas([a], pending(call("y", 64)))  # nothing else: it may still be tried
    assert [[x.replica_id.unique_id for x in rank] for rank in alone] == [["a"]]


@pytest.mark.asyncio
async def test_a_replica_whose_queue_is_at_its_wait_bound_is_left_out_while_another_has_room():
    """b holds x's prefix, so it is the pick while it has room; once b reports its queue full (it
    would answer 429) the router sends x to a; with every replica full, all are candidates (the
    gate then refuses with Retry-After); a stalled replica goes before a full one."""
    r, _ = router()
    ok = rstats(T0, kv_blocks_total=1000, max_num_seqs=8)
    x = call("x", 256)
    r.host.index.record_routed(r._index_of(replica("b").replica_id), x.block_hashes)

    def ids(ranks):
        return [[rep.replica_id.unique_id for rep in rank] for rank in ranks]

    assert ids(await r.choose_replicas([replica("a", ok), replica("b", ok)], pending(x)))[0] == ["b"]
    full = dataclasses.replace(ok, full=True)
    assert ids(await r.choose_replicas([replica("a", ok), replica("b", full)], pending(call("x", 256)))) == [["a"]]
    both = await r.choose_replicas([replica("a", full), replica("b", full)], pending(call("x", 256)))
    assert sorted(rep.replica_id.unique_id for rank in both for rep in rank) == ["a", "b"]
    stalled = dataclasses.replace(ok, stalled=True)
    rest = await r.choose_replicas([replica("a", stalled), replica("b", full)], pending(call("x", 256)))
    assert ids(rest) == [["b"]]


@pytest.mark.asyncio
async def test_a_replicas_reported_drain_rate_becomes_its_speed_clamped():
    r, _ = router()
    reps = [replica("a", rstats(T0, drain_rate=0.25)), replica("b", rstats(T0, drain_rate=1e-6))]
    await r.choose_replicas(reps, pending(call("x", 64)))
    ja, jb = (r._index_of(rep.replica_id) for rep in reps)
    speed = r.load.live().speed
    assert (speed[ja], speed[jb]) == (0.25, 0.05)  # a rate near zero is clamped, never divides by 0


# -- the exact prefix view: the replicas' KV events through the hub --------------------------------


def test_the_exact_view_routes_on_the_replicas_kv_events_from_a_snapshot_then_deltas():
    import asyncio

    async def run():
        from router.view_hub import ViewHub

        hub = ViewHub()
        doc = chain("doc", 64)
        # replica-1 computed the prompt before any router started (another path, a restart)
        assert hub.publish("replica:replica-1", [KvDelta("replica-1", doc, [])], now=0.0)  # unknown: send all
        assert not hub.publish("replica:replica-1", [KvFull("replica-1", doc)], now=0.0)
        (a, b), _ = shared_pair(prefix_view="events", hub=hub)
        reps = [replica("replica-0"), replica("replica-1")]
        assert a.index.mode == "approx"  # no snapshot yet: the fallback
        assert await a.sync_once()
        assert a.index.mode == "events" and not a._need_snapshot
        j1 = a.bookings.index_of("replica-1")
        c = GenerateCall(request_id="x", prompt_token_ids=[1] * 1024, block_hashes=tuple(doc), max_tokens=4,
                         arrival_s=T0)
        assert (await a.choose_replicas(reps, pending(c)))[0] == [reps[1]]
        assert a.bookings.get("iid-x").estimated_blocks == 64
        # replica-1 evicts the tail: a delta, and the next exchange applies it
        assert not hub.publish("replica:replica-1", [KvDelta("replica-1", [], doc[32:])], now=0.0)
        assert await a.sync_once()
        assert a.index.match(doc)[j1] == 32
        assert a.kv_hashes_applied == 64 + 64 + 32  # the log's two batches replayed onto the snapshot, the delta
        # the approximate index never saw replica-1's blocks: exact routing was the events' doing
        assert a.index.approx.match(doc)[j1] == 0

    asyncio.run(run())


@pytest.mark.asyncio
async def test_lost_kv_events_fall_back_to_the_approximate_view_until_a_new_snapshot():
    from router.view_hub import ViewHub

    hub = ViewHub(capacity=2)  # a ring of two events: a router that falls behind has a gap
    (a, b), _ = shared_pair(prefix_view="events", hub=hub)
    assert await a.sync_once() and a.index.mode == "events"
    for i in range(3):  # three batches while a does not exchange: the first is dropped
        hub.publish("replica:replica-0", [KvDelta("replica-0", [i], [])], now=0.0)
    assert await a.sync_once()
    assert a.view_gaps == 1 and a._need_snapshot and a.index.mode == "approx"
    assert await a.sync_once()  # this exchange carries the snapshot
    assert a.index.mode == "events" and sorted(a.index.blocks(a.bookings.index_of("replica-0"))) == [0, 1, 2]


@pytest.mark.asyncio
async def test_an_unreachable_hub_falls_back_to_the_approximate_view_and_returns_to_the_exact_one():
    fail = [False]
    (a, b), hub = shared_pair(fail, prefix_view="events")
    assert await a.sync_once() and a.index.mode == "events"
    fail[0] = True
    assert not await a.sync_once() and a.view_degraded and a.index.mode == "approx"
    fail[0] = False
    assert await a.sync_once() and not a.view_degraded and a.index.mode == "events"


@pytest.mark.asyncio
async def test_a_replica_that_stops_publishing_is_forgotten_and_resends_its_whole_set():
    from router.view_hub import ViewHub

    hub = ViewHub(ttl_s=3.0)
    (a, b), _ = shared_pair(prefix_view="events", hub=hub)
    a.bookings.replica("replica-0")
    assert hub.publish("replica:replica-0", [KvFull("replica-0", [7, 8])], now=0.0) is False
    hub.exchange(a.router_id, [], 0, now=10.0)  # the replica has been silent 10 s > 3 s: gone
    assert "replica-0" not in hub.kv
    ex = hub.exchange(b.router_id, [], 0, now=10.0)
    for e in ex.events:
        b.bookings.apply_remote(e)
    assert SourceGone("replica:replica-0") in ex.events
    assert list(b.index.exact.blocks(b.bookings.index_of("replica-0"))) == []
    assert hub.publish("replica:replica-0", [], now=11.0) is True  # back: the hub asks for everything


# -- the host KV tier through the exact view: GPU hit / host hit / miss ----------------------------


def events_router(hub, policy: str = "fairway", **options) -> FairwayRequestRouter:
    """One router on the exact view (``prefix_view: events``) over ``hub`` (called directly)."""
    clock = ManualClock(T0)

    async def exchange(source, events, after, snapshot=False):
        return hub.exchange(source, list(events), after, snapshot, now=0.0)

    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(policy=policy, policy_options=options, metrics=False, clock=clock, wall=clock.now,
                       exchange=exchange, prefix_view="events")
    r._sync_task = False
    return r


@pytest.mark.asyncio
async def test_the_exact_view_applies_host_only_sets_from_the_snapshot_and_tier_events():
    from router.view_hub import ViewHub

    hub = ViewHub()
    doc = chain("doc", 64)
    hub.publish("replica:replica-0", [KvFull("replica-0", doc, doc)], now=0.0)  # all host-only
    hub.publish("replica:replica-1", [KvFull("replica-1", doc)], now=0.0)  # all on the GPU
    r = events_router(hub)
    assert await r.sync_once() and r.index.mode == "events"
    j0, j1 = r.bookings.index_of("replica-0"), r.bookings.index_of("replica-1")
    assert (j0, j1) == (0, 1) and r.index.match_tiers(doc) == ([64, 64], [64, 0])
    assert r.kv_hashes_applied == (64 + 64) + 64  # the log's two whole sets, replayed onto the snapshot
    # replica-0 reloads the first half (back on its GPU); replica-1 offloads its last 16 blocks
    hub.publish("replica:replica-0", [TierDelta("replica-0", [], doc[:32])], now=0.0)
    hub.publish("replica:replica-1", [KvDelta("replica-1", [], []), TierDelta("replica-1", doc[48:], [])], now=0.0)
    assert await r.sync_once()
    assert r.index.match_tiers(doc) == ([64, 64], [32, 16])
    assert sorted(r.index.exact.host_only(j1)) == sorted(doc[48:])
    # replica-0 resends its whole set with nothing host-only (the 3-field event): none left
    hub.publish("replica:replica-0", [KvFull("replica-0", doc)], now=0.0)
    assert await r.sync_once() and r.index.match_tiers(doc) == ([64, 64], [0, 16])
    # a router that starts now gets the same split from the snapshot alone
    late = events_router(hub)
    assert await late.sync_once() and late.index.match_tiers(doc) == ([64, 64], [0, 16])
    # replica-1 is gone: its blocks and its host-only set leave the index
    r.bookings.apply_remote(SourceGone("replica:replica-1"))
    assert r.index.match_tiers(doc) == ([64, 0], [0, 0]) and r.index.exact.host_only(j1) == set()


@pytest.mark.asyncio
async def test_fairway_prefers_a_gpu_hit_to_a_host_hit_of_the_same_prefix_and_is_blind_without_tiers():
    from router.view_hub import ViewHub

    hub = ViewHub()
    doc = chain("doc", 64)
    hub.publish("replica:replica-0", [KvFull("replica-0", doc, doc)], now=0.0)  # a reload on 0
    hub.publish("replica:replica-1", [KvFull("replica-1", doc[:62])], now=0.0)  # GPU, 2 blocks short
    reps = [replica("replica-0"), replica("replica-1")]
    c = GenerateCall(request_id="x", prompt_token_ids=[1] * 1024, block_hashes=tuple(doc), max_tokens=4,
                     arrival_s=T0)
    aware, blind = events_router(hub), events_router(hub, host_tier=False)
    assert await aware.sync_once() and await blind.sync_once()
    decisions: dict = {}
    for name, r in (("aware", aware), ("blind", blind)):  # keep each router's decision (its Ranking's scores)
        def decide(*a, _decide=r.host.decide, _name=name, **k):
            decisions[_name] = _decide(*a, **k)
            return decisions[_name]
        r.host.decide = decide
    # tier-blind: replica-0 caches 63 blocks (the cap) against 62; tier-aware: its 1008 tokens reload
    # (1008 x 128 KiB / 50 GB/s = 2.6 ms) cost more than replica-1's 16-token recompute
    assert (await blind.choose_replicas(reps, pending(c)))[0] == [reps[0]]
    assert (await aware.choose_replicas(reps, pending(c)))[0] == [reps[1]]
    s0, s1 = decisions["aware"].ranking.scores[0], decisions["aware"].ranking.scores[1]
    b0 = decisions["blind"].ranking.scores[0]
    assert s0 - b0 == pytest.approx(1008 * aware.cost.kv_bytes_per_token() / 50e9)
    assert s1 < s0


@pytest.mark.asyncio
async def test_a_retried_request_avoids_the_replica_that_refused_it():
    """``GenerateCall.avoid`` (the replicas whose gates refused it) leaves them out while another
    replica is a candidate; with none left, every candidate stays."""
    import dataclasses

    r, _ = router("ray-prefix")
    reps = [replica("replica-0"), replica("replica-1")]
    first = call("a", 4096, family="doc")
    pick = (await r.choose_replicas(reps, pending(first)))[0][0]
    retry = dataclasses.replace(first, avoid=(pick.replica_id.unique_id,))
    ranks = await r.choose_replicas(reps, pending(retry))
    assert [rep.replica_id.unique_id for rank in ranks for rep in rank] == [
        u for u in ("replica-0", "replica-1") if u != pick.replica_id.unique_id]
    everywhere = dataclasses.replace(first, avoid=("replica-0", "replica-1"))
    ranks = await r.choose_replicas(reps, pending(everywhere))
    assert sorted(rep.replica_id.unique_id for rank in ranks for rep in rank) == ["replica-0", "replica-1"]
