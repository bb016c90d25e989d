"""The live router's ledger (``fairway/routing/bookings.py``) on a manual clock: bookings, sends,
completions, the replicas' stats and the shared view's events, through the public API only, with
exact expectations (which replicas changed, what the load view and the index hold)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fairway.clock import ManualClock
from fairway.cost_model import CostModel
from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig
from fairway.prefix_index import PrefixIndex
from fairway.protocol import ReplicaRoutingStats
from fairway.routing import make_router
from fairway.routing.bookings import Bookings, CachedTokens, Changes
from fairway.routing.fallback_index import FallbackIndex
from fairway.routing.host import RoutingHost
from fairway.routing.view_log import (
    KvDelta,
    KvFull,
    RequestFinished,
    RequestRouted,
    SourceGone,
    TierDelta,
)
from tests.factories import chain

T0 = 100.0  # the manual clock's start; the wall (the replicas' stats stamps) is the same clock
BS = 16


def ledger(replicas: int = 2, exact: bool = False, policy: str = "ray-prefix", classes: str = "",
           **limits: int) -> tuple[Bookings, ManualClock]:
    """A ledger over a fresh host with ``replicas`` replicas ("r0", "r1", ...: indices 0, 1, ...)
    and the request ``classes`` (a ``ClassesConfig.parse`` spec)."""
    clock = ManualClock(T0)
    cost = CostModel.from_profile("h200-llama3-8b")
    host = RoutingHost(make_router(policy, clock=clock, cost=cost, block_size=BS, rng=np.random.default_rng(0)),
                       FallbackIndex(0) if exact else PrefixIndex(0), LoadView(0, clock, cost, block_size=BS),
                       block_size=BS, classes=ClassesConfig.parse(classes))
    b = Bookings(host, clock, clock.now, source="me", exact=exact, **limits)
    for j in range(replicas):
        assert b.replica(f"r{j}") == j
    return b, clock


def stats(taken_at: float, **fields) -> ReplicaRoutingStats:
    return ReplicaRoutingStats(taken_at=taken_at, kv_usage=fields.pop("kv_usage", 0.0),
                               kv_blocks_total=fields.pop("kv_blocks_total", 0), **fields)


def outstanding(b: Bookings) -> tuple[int, ...]:
    return b.host.load.live().outstanding


def test_replicas_are_numbered_on_first_sight_and_looked_up_without_adding():
    b, _ = ledger(replicas=0)
    assert b.index_of("x") is None and b.names == []
    assert (b.replica("x"), b.replica("y"), b.replica("x")) == (0, 1, 0)
    assert b.names == ["x", "y"] and b.index_of("y") == 1 and b.host.load.num_replicas == 2


def test_a_choice_is_booked_at_once_so_a_burst_spreads():
    b, _ = ledger()
    hashes = chain("doc", 8)
    d1, c1 = b.choose("k1", "a", 8 * BS, hashes, [0, 1])
    d2, c2 = b.choose("k2", "b", 8 * BS, chain("other", 8), [0, 1])
    assert (d1.pick, d2.pick) == (0, 1)  # the second sees the first's booking: the shorter queue
    assert c1.replicas == [0] and c2.replicas == [1] and c1.cached == []
    assert c1.booking == b.get("k1") and c1.booking.request_id == "a" and c1.booking.hashes == tuple(hashes)
    assert not c1.booking.sent and c1.booking.routed_at == T0
    assert outstanding(b) == (1, 1) and len(b) == 2 and list(b) == ["k1", "k2"]


def test_a_retry_under_the_same_key_replaces_its_booking():
    b, _ = ledger()
    _, first = b.choose("k", "a", 64, chain("a", 4), [0])
    _, again = b.choose("k", "a", 64, chain("a", 4), [1])
    assert again.replicas == [0, 1] and again.booking is b.get("k") and again.booking is not first.booking
    assert outstanding(b) == (0, 1)


def test_a_send_to_another_replica_of_the_rank_moves_the_booking_and_keeps_its_reason():
    b, _ = ledger()
    hashes = chain("doc", 4)
    b.host.index.record_routed(1, hashes[:2])  # r1 holds half the prompt
    c = b.book("k", "a", 0, 4 * BS, hashes, 0, reason="cold", best_blocks=3)
    assert c.replicas == [0] and c.booking.best_blocks == 3
    sent = b.sent("k", 1, "a", 4 * BS, hashes)
    moved = sent.booking
    assert sent.replicas == [0, 1] and moved is b.get("k") and moved.replica == 1
    assert (moved.reason, moved.estimated_blocks, moved.best_blocks, moved.sent) == ("cold", 2, 3, True)
    assert outstanding(b) == (0, 1) and b.host.index.match(hashes) == [0, 4] and b.host.reasons == {"cold": 1}
    # a send to the booked replica changes no load: it only dates the booking and records the prompt
    b.book("k2", "b", 0, BS, chain("b", 1), 0)
    assert b.sent("k2", 0, "b", BS, chain("b", 1)).replicas == []


def test_an_unbooked_request_that_is_sent_is_booked_where_it_went():
    b, _ = ledger()
    c = b.sent("k", 1, "a", 2 * BS, chain("a", 2))
    assert c.replicas == [1] and c.booking.reason == "choice" and c.booking.sent and outstanding(b) == (0, 1)


def test_a_completion_ends_the_booking_only_on_its_replica():
    b, _ = ledger()
    b.book("k", "a", 1, 64, chain("a", 4), 0)
    assert b.complete("k", 0) == Changes() and b.complete("k", None) == Changes()  # an earlier attempt
    assert b.complete("nope", 1) == Changes()
    done = b.complete("k", 1)
    assert done.replicas == [1] and done.booking.request_id == "a"
    assert "k" not in b and b.awaiting_feedback("a") and outstanding(b) == (0, 0)


def test_a_completion_reported_before_its_send_is_not_booked_again():
    """Ray registers its completion callback before it awaits the replica's acceptance, so a
    short request can be reported ended before it is reported sent: the late send must not book
    it again (nothing would ever end that booking)."""
    b, _ = ledger()
    hashes = chain("a", 4)
    d, _ = b.choose("k", "a", 4 * BS, hashes, [0, 1])
    done = b.complete("k", d.pick)
    assert done.replicas == [d.pick] and not done.booking.sent and outstanding(b) == (0, 0)
    late = b.sent("k", d.pick, "a", 4 * BS, hashes)
    assert late.ended and late.booking is done.booking and late.booking.sent and late.replicas == []
    assert "k" not in b and outstanding(b) == (0, 0) and b.awaiting_feedback("a")
    expected = [0, 0]
    expected[d.pick] = 4
    assert b.host.index.match(hashes) == expected  # the send still tells the index where it went
    assert b.sent("k", d.pick, "a", 4 * BS, hashes).booking.sent and outstanding(b)[d.pick] == 1  # once only


def test_a_retry_after_a_refused_attempt_is_booked_and_counted():
    """A refused attempt ends unsent (Ray cancels it), then the retry is chosen and sent: the retry
    is a new booking, counted until its own completion, even on the same replica."""
    b, _ = ledger()
    b.choose("k", "a", 64, chain("a", 4), [0])
    assert b.complete("k", 0).booking is not None  # the refusal
    b.choose("k", "a", 64, chain("a", 4), [0])  # the retry
    sent = b.sent("k", 0, "a", 64, chain("a", 4))
    assert not sent.ended and sent.booking is b.get("k") and outstanding(b) == (1, 0)
    assert b.complete("k", 0).replicas == [0] and outstanding(b) == (0, 0)


def test_an_unsent_booking_goes_only_while_it_is_the_keys_booking():
    b, _ = ledger()
    first = b.book("k", "a", 0, 64, chain("a", 4), 0).booking
    second = b.book("k", "a", 1, 64, chain("a", 4), 0).booking  # a retry replaced it (no unbook: both held)
    assert b.unbook_unsent("k", first) == Changes()  # not the key's booking any more
    sent = b.book("s", "s", 0, 64, chain("s", 4), 0).booking
    b.sent("s", 0, "s", 64, chain("s", 4))
    assert b.unbook_unsent("s", sent) == Changes() and "s" in b  # it was sent
    assert b.unbook_unsent("k", second).replicas == [1] and "k" not in b
    assert b.unbook("k") == Changes()


def test_beyond_max_tracked_the_oldest_booking_is_forgotten():
    b, _ = ledger(max_tracked=2)
    b.book("k0", "a", 0, 64, chain("a", 4), 0)
    b.book("k1", "b", 1, 64, chain("b", 4), 0)
    c = b.book("k2", "c", 1, 64, chain("c", 4), 0)
    assert c.replicas == [0, 1] and list(b) == ["k1", "k2"] and outstanding(b) == (0, 2)


def test_a_sent_booking_forgotten_stops_counting_in_flight():
    """Beyond ``max_tracked`` a sent booking is forgotten with no report to come: the exact index
    no longer counts its prompt in flight, and the pinned approximate one keeps it as a finished
    prompt (likely computed there); an unsent booking was never in flight."""
    b, _ = ledger(exact=True, max_tracked=1)
    index = b.host.index
    b.book("k0", "a", 0, 64, chain("a", 4), 0)
    b.sent("k0", 0, "a", 64, chain("a", 4))
    assert index.exact.match(chain("a", 4)) == [4, 0] and index.approx.match(chain("a", 4)) == [4, 0]
    assert list(index.approx.blocks(0)) == []  # in flight, not in the free pool
    b.book("k1", "b", 1, 64, chain("b", 4), 0)
    assert list(b) == ["k1"]
    assert index.exact.match(chain("a", 4)) == [0, 0] and index.approx.match(chain("a", 4)) == [4, 0]
    assert index.approx.size(0) == 4 and list(index.approx.blocks(0)) == chain("a", 4)[::-1]
    b.book("k2", "c", 0, 64, chain("c", 4), 0)
    assert index.exact.match(chain("b", 4)) == [0, 0]


def test_beyond_max_awaiting_feedback_the_oldest_finished_request_gets_none():
    b, _ = ledger(max_awaiting_feedback=1)
    for k in ("a", "b"):
        b.book(k, k, 0, 64, chain(k, 4), 0)
        b.complete(k, 0)
    assert not b.awaiting_feedback("a") and b.awaiting_feedback("b")
    assert b.apply_stats(0, stats(T0, recent_cached={"a": 64})).cached == []


def test_a_finished_request_whose_report_never_comes_leaves_flight_as_computed():
    """Beyond ``max_awaiting_feedback`` the oldest finished request gets no report: the exact
    index stops counting its prompt in flight, the pinned approximate one keeps it as finished
    (in the free pool)."""
    b, _ = ledger(exact=True, max_awaiting_feedback=1)
    index = b.host.index
    for k in ("a", "b"):
        b.book(k, k, 0, 64, chain(k, 4), 0)
        b.sent(k, 0, k, 64, chain(k, 4))
        b.complete(k, 0)
    assert index.exact.match(chain("a", 4)) == [0, 0] and index.exact.match(chain("b", 4)) == [4, 0]
    assert list(index.approx.blocks(0)) == chain("a", 4)[::-1] and index.approx.match(chain("b", 4)) == [4, 0]


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        ledger(max_tracked=0)


# -- the replicas' stats -----------------------------------------------------------------------


def test_stats_start_the_requests_that_left_the_queue_and_date_their_prefill():
    b, clock = ledger(replicas=1)
    for k in ("a", "b", "c", "late"):  # a: prefilling since T0 - 0.5; b: past its prefill; c: waiting
        b.book(k, k, 0, 20000, chain(k, 4), 0, routed_at=T0 - 5.0 if k != "late" else T0)
    pa = b.host.load.snapshot().queued_prefills[0][0]
    c = b.apply_stats(0, stats(T0 - 0.1, waiting_ids=["c"], prefilling={"a": T0 - 0.5}, admitted_ids=["a", "b"],
                               kv_usage=0.5, kv_blocks_total=1000, max_num_seqs=8, drain_rate=0.01))
    assert c == Changes([0])
    snap = b.host.load.snapshot()
    assert snap.running == (2,) and snap.prefill_ends[0] == (T0 - 0.5 + pa,)
    assert snap.queued_prefills[0] == (pa, pa)  # c waits; "late" was routed after the report
    assert snap.kv_usage == (0.5,) and snap.max_running == (8,) and b.host.load.live().speed == (0.05,)
    assert b.host.index.capacity(0) == 1000
    assert b.apply_stats(0, stats(T0 - 0.1, prefilling={})) == Changes()  # the same report again: ignored
    clock.advance(1.0)
    b.apply_stats(0, stats(T0 + 0.5, waiting_ids=["c"], admitted_ids=["a", "b", "late"]))
    assert b.host.load.snapshot().prefill_ends[0] == ()  # "a" and "late" past their prefill too


def test_a_booking_its_replica_no_longer_holds_long_after_routing_is_expired():
    """Reconciliation: a request the replica lists nowhere (not waiting, not admitted, not
    recently finished) in a report taken more than ``stale_after_s`` after it was routed ended
    unheard (a lost completion): it leaves the load view. Younger, listed, or without the
    replica's admitted list, it stays."""
    b, _ = ledger(stale_after_s=15.0)
    hashes = tuple(chain("a", 4))
    for key, rid, j in (("k", "a", 0), ("held", "h", 0), ("other", "o", 1)):
        b.sent(key, j, rid, 4 * BS, hashes)
    b.apply_remote(RequestRouted("r0", "peer:1", hashes, 4 * BS, 0, "p", T0, 0))
    assert outstanding(b) == (3, 1)
    young = b.apply_stats(0, stats(T0 + 10.0, admitted_ids=["h"]))
    assert young.expired == 0 and outstanding(b) == (3, 1)  # in transit, as far as 10 s can tell
    blind = b.apply_stats(0, stats(T0 + 20.0))  # no admitted list: nothing can be told
    assert blind.expired == 0 and outstanding(b) == (3, 1)
    c = b.apply_stats(0, stats(T0 + 30.0, admitted_ids=["h"]))
    assert c.expired == 2 and c.replicas == [0] and list(b) == ["held", "other"] and outstanding(b) == (1, 1)
    assert not b.awaiting_feedback("a")  # no report will come for it
    assert b.complete("k", 0) == Changes()  # its completion, if it ever comes, changes nothing
    assert b.apply_stats(0, stats(T0 + 40.0, waiting_ids=["h"], admitted_ids=[])).expired == 0  # waiting
    assert b.apply_stats(0, stats(T0 + 50.0, admitted_ids=[], recent_cached={"h": 0})).expired == 0
    with pytest.raises(ValueError):
        ledger(stale_after_s=0)


def test_a_request_in_none_of_the_replicas_lists_is_still_in_transit():
    b, _ = ledger(replicas=1)
    b.book("k", "a", 0, 20000, chain("a", 4), 0, routed_at=T0 - 5.0)
    b.apply_stats(0, stats(T0, admitted_ids=[]))
    assert b.host.load.snapshot().running == (0,)
    b.apply_stats(0, stats(T0 + 1, admitted_ids=None))  # not reported: off the waiting list means started
    assert b.host.load.snapshot().running == (1,)


def test_cached_token_reports_correct_the_index_and_count_only_this_routers_requests():
    b, _ = ledger()
    hashes = chain("doc", 8)
    b.book("k", "a", 1, 8 * BS, hashes, 3)
    b.sent("k", 1, "a", 8 * BS, hashes)
    b.complete("k", 1)
    b.apply_remote(RequestRouted("r1", "other:7", tuple(chain("x", 4)), 4 * BS, 2, "x", T0, 2))
    b.apply_remote(RequestFinished("other:7"))
    c = b.apply_stats(1, stats(T0, kv_blocks_total=100, recent_cached={"a": 2 * BS, "x": BS, "unknown": 5}))
    assert c == Changes([1], [CachedTokens(1, 3 * BS, 2 * BS, 8 * BS)])  # the remote "x" is not counted here
    assert not b.awaiting_feedback("a") and not b.awaiting_feedback("x")
    # both reports corrected the index: each hit one block short of its estimate shrank r1's capacity
    assert b.host.index.capacity(1) == 100 - 1 - 1
    # a report of another replica than the request's is not its feedback (and is consumed)
    b.book("k2", "b", 0, 64, chain("b", 4), 0)
    b.complete("k2", 0)
    assert b.apply_stats(1, stats(T0 + 1, recent_cached={"b": 64})).cached == [] and not b.awaiting_feedback("b")


def test_a_direct_cached_report_is_taken_once_and_a_failed_request_releases_its_blocks():
    clock = ManualClock(T0)
    cost = CostModel.from_profile("h200-llama3-8b")
    host = RoutingHost(make_router("ray-prefix", clock=clock, cost=cost, block_size=BS),
                       PrefixIndex(2, mode="events"), LoadView(2, clock, cost, block_size=BS), block_size=BS)
    b = Bookings(host, clock, clock.now, source="me", known=["r0", "r1"])
    for key in ("k1", "k2"):
        b.sent(key, 1, key, 4 * BS, chain(key, 4))
        b.complete(key, 1)
        assert host.index.match(chain(key, 4)) == [0, 4]  # in flight until its report
    assert b.report_cached("k1", 0, 2 * BS) == Changes() and not b.awaiting_feedback("k1")  # other replica
    assert host.index.match(chain("k1", 4)) == [0, 4]  # ... is not its report (and is consumed)
    assert b.report_cached("k2", 1, -1) == Changes() and not b.awaiting_feedback("k2")
    assert host.index.match(chain("k2", 4)) == [0, 0]  # failed: its blocks no longer count in flight
    assert b.report_cached("k2", 1, 0) == Changes()  # a report is taken once


def test_a_host_that_hears_each_event_starts_preempts_and_releases_a_prefill():
    b, clock = ledger(policy="llmd")
    b.sent("k", 0, "a", 8 * BS, chain("a", 8))
    queued = b.host.load.live().queued_prefill_tokens
    assert queued == (8 * BS, 0)
    clock.advance(1.0)
    b.started("k")
    assert b.get("k").started and b.host.load.live().queued_prefill_tokens == (0, 0)
    assert b.host.load.live().active_prefill_tokens == (8 * BS, 0)  # held until the first token (llmd)
    b.first_token("k")
    assert b.host.load.live().active_prefill_tokens == (0, 0)
    b.preempted("k", 8 * BS)
    assert not b.get("k").started and b.host.load.live().queued_prefill_tokens == (8 * BS, 0)
    b.started("missing")  # an unknown key changes nothing
    assert outstanding(b) == (1, 0)


def test_ledgers_over_one_load_view_share_one_set_of_request_ids():
    clock = ManualClock(T0)
    cost = CostModel.from_profile("h200-llama3-8b")
    index, load = PrefixIndex(2), LoadView(2, clock, cost, block_size=BS)
    rids = itertools.count()
    ledgers = [Bookings(RoutingHost(make_router("ray-prefix", clock=clock, cost=cost, block_size=BS),
                                    index, load, block_size=BS), clock, clock.now, source=f"s{k}",
                        known=["r0", "r1"], rids=rids) for k in range(2)]
    assert ledgers[0].index_of("r1") == 1 and ledgers[0].names == ["r0", "r1"]
    one = ledgers[0].sent("a", 0, "a", 64, chain("a", 4)).booking
    two = ledgers[1].sent("b", 0, "b", 64, chain("b", 4)).booking
    assert (one.rid, two.rid) == (0, 1) and load.live().outstanding == (2, 0)
    ledgers[0].complete("a", 0)
    assert load.live().outstanding == (1, 0)  # the other ledger's request is still there


# -- the shared view ---------------------------------------------------------------------------


def test_another_routers_request_is_adopted_once_and_ends_with_its_finish():
    b, _ = ledger()
    hashes = tuple(chain("doc", 4))
    event = RequestRouted("r1", "other:3", hashes, 4 * BS, 1, "x", T0 - 1.0, 2)
    c = b.apply_remote(event)
    assert c.replicas == [1] and c.cached == [] and list(b) == ["remote:other:3"]
    adopted = b.get("remote:other:3")
    assert adopted.remote and adopted.replica == 1 and adopted.routed_at == T0 - 1.0
    assert outstanding(b) == (0, 1) and b.host.index.match(hashes) == [0, 4] and b.host.reasons == {}
    assert b.apply_remote(event) == Changes() and outstanding(b) == (0, 1)  # a batch sent twice
    done = b.apply_remote(RequestFinished("other:3"))
    assert done.replicas == [1] and b.awaiting_feedback("x") and outstanding(b) == (0, 0)
    assert b.apply_remote(RequestFinished("other:3")) == Changes()


def test_a_request_keeps_its_class_through_a_move_and_across_the_shared_view():
    b, _ = ledger(classes="interactive:tier=0,batch:tier=1")
    d, _ = b.choose("k", "a", 4 * BS, chain("a", 4), klass="interactive")
    moved = b.sent("k", 1 - d.pick, "a", 4 * BS, chain("a", 4)).booking  # sent elsewhere in the rank
    assert moved.klass == "interactive"
    event = b.routed_event(moved)
    assert event.klass == "interactive"
    other, _ = ledger(classes="interactive:tier=0,batch:tier=1")
    other.apply_remote(event)
    expected: list[set[str]] = [set(), set()]
    expected[1 - d.pick] = {"interactive"}
    assert [set(q) for q in other.host.load.snapshot().class_queues] == expected
    assert other.get(f"remote:{event.key}").klass == "interactive"


def test_a_gone_router_takes_its_requests_in_flight_with_it_and_a_replica_its_blocks():
    b, _ = ledger()
    b.book("mine", "m", 0, 64, chain("m", 4), 0)
    for n, j in ((1, 0), (2, 1)):
        b.apply_remote(RequestRouted(f"r{j}", f"other:{n}", tuple(chain(str(n), 4)), 64, 0, str(n), T0, 0))
    b.apply_remote(RequestRouted("r1", "third:1", tuple(chain("t", 4)), 64, 0, "t", T0, 0))
    assert b.apply_remote(SourceGone("me")) == Changes()  # its own announcement: nothing to drop
    c = b.apply_remote(SourceGone("other"))
    assert c.replicas == [0, 1] and list(b) == ["mine", "remote:third:1"] and outstanding(b) == (1, 1)
    assert b.host.index.match(chain("1", 4)) == [4, 0]  # where its prompts went is still known


def test_the_events_of_this_routers_requests_name_them_by_its_source():
    b, _ = ledger()
    booking = b.sent("k", 1, "a", 2 * BS, chain("a", 2)).booking
    assert b.routed_event(booking) == RequestRouted("r1", f"me:{booking.rid}", tuple(chain("a", 2)), 2 * BS, 0,
                                                    "a", T0, 0)
    assert b.finished_event(booking) == RequestFinished(f"me:{booking.rid}")


def test_the_replicas_kv_events_reach_only_an_exact_index_and_are_counted():
    doc = chain("doc", 8)
    approx, _ = ledger()
    assert approx.apply_remote(KvFull("r0", doc)) == Changes() and approx.kv_hashes_applied == 0
    assert approx.host.index.match(doc) == [0, 0]
    b, _ = ledger(exact=True)
    b.host.index.use_exact(True)
    b.apply_snapshot({"r0": doc[:2], "r2": doc}, {"r2": doc[4:]})  # a replica first seen in the snapshot
    assert b.names == ["r0", "r1", "r2"] and b.host.index.match_tiers(doc) == ([2, 0, 8], [0, 0, 4])
    assert b.apply_remote(KvDelta("r1", doc[:4], [])) == Changes()
    b.apply_remote(KvFull("r0", doc, doc[6:]))
    b.apply_remote(TierDelta("r2", [], doc[4:6]))
    assert b.host.index.match_tiers(doc) == ([8, 4, 8], [2, 0, 2])
    assert b.kv_hashes_applied == 4 + (8 + 2) + 2
    b.apply_remote(SourceGone("replica:r0"))
    assert b.host.index.match(doc) == [0, 4, 8]
