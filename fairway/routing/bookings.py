"""A live router's ledger: the requests it has booked on replicas, reconciled with what the
replicas report and what the other routers of the shared view routed.

Why: a router that runs next to live replicas (``router/serve_router.py``) learns a request's life
from several sources that arrive in any order: its own choice (booked at once, so a burst that
sees the same load does not herd onto one replica), the send (possibly to another replica of the
rank, or never: its caller left), the completion, the replicas' periodic
``ReplicaRoutingStats`` (which of its requests started, which are past their prefill, the cached
tokens the finished ones got) and the other routers' ``fairway/routing/view_log.py`` events. This
class keeps the bookings and applies all of them to one ``RoutingHost`` (the policy, its prefix
index and load view), so the logic is pure, runs on an injected clock, and is tested without Ray.
The simulator's router instances (``sim/cluster.py``) run on it too: they hear each request's life
from the engine models directly (``started``, ``first_token``, ``preempted``, ``complete``,
``report_cached``) instead of through stats reports, and exchange the shared view's events.

Each mutating method returns a ``Changes``: the replicas whose load (outstanding, queued prefill)
changed, which the host publishes (gauges), and the cached-token reports of this router's own
requests (counters). Replicas are the host's indices; ``replica(uid)`` maps a replica's unique id
to one, adding it on first sight.

Terms: a *key* names a booking (the caller's request id; another router's are
``"remote:<router>:<n>"``); ``wall`` is the time base of the replicas' stats stamps and of
``routed_at`` (``time.time`` live), ``clock`` the load view's. Complexity: a booking, a send, a
completion and a remote event O(1) plus the host's work (O(prompt blocks)); a stats report
O(tracked requests + its lists); a dead router O(tracked requests). Memory: at most
``max_tracked`` bookings and ``max_awaiting_feedback`` finished requests.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from fairway.clock import Clock
from fairway.protocol import ReplicaRoutingStats
from fairway.routing.host import Decision, RoutingHost
from fairway.routing.view_log import (
    REPLICA_SOURCE,
    Event,
    KvDelta,
    KvFull,
    RequestFinished,
    RequestRouted,
    SourceGone,
    TierDelta,
)

MAX_AWAITING_FEEDBACK = 4096  # finished requests kept until their cached-token report arrives
MAX_TRACKED = 65536  # outstanding requests tracked per router
#: A booking whose replica, in a report taken this long after the booking was routed, holds the
#: request nowhere (not waiting, not in its engine, not among its recently finished) has ended
#: without this router hearing it: it leaves the load view (``Bookings.apply_stats``). Far longer
#: than a request takes to reach its replica (milliseconds), so only a lost completion matches.
STALE_AFTER_S = 15.0
SPEED_RANGE = (0.05, 20.0)  # a replica's reported drain rate is clamped into this before it is used
REMOTE = "remote:"  # the key prefix of another router's requests


@dataclass(slots=True)
class Booking:
    """One request this router booked (or adopted from another router) on ``replica``.

    ``rid`` is its id in the host's load view; ``estimated_blocks`` the index's match on
    ``replica`` when booked; ``routed_at`` the wall time it was booked or sent (a replica's report
    taken before it cannot have seen it); ``started``: a report showed it left the replica's queue;
    ``sent``: the send was seen; ``remote``: another router's; ``best_blocks``: the decision's
    longest match among the candidates (the policy's statistics); ``klass``: its request class
    ("" without classes); ``expected_s``: the decision's expected first-token time per candidate
    (``Ranking.expected_s``), kept until the send, which sets ``expected_ttft_s``: the one on the
    replica it was sent to (0: the policy predicts none)."""

    rid: int
    request_id: str
    replica: int
    hashes: tuple[int, ...]
    estimated_blocks: int
    prompt_tokens: int
    routed_at: float
    started: bool = False
    sent: bool = False
    reason: str = "choice"
    remote: bool = False
    best_blocks: int = 0
    klass: str = ""
    expected_s: Mapping[int, float] | None = None
    expected_ttft_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """A replica's cached-token report for one of this router's own requests: ``estimated_tokens``
    (the index's estimate when booked), ``cached_tokens`` (what the engine found), out of
    ``prompt_tokens``."""

    replica: int
    estimated_tokens: int
    cached_tokens: int
    prompt_tokens: int


@dataclass(slots=True)
class Changes:
    """What one call changed: ``replicas`` whose load changed (in order, possibly repeated),
    ``cached`` reports to count, and ``booking``: the booking the call made, sent or completed
    (None when there was none); ``ended``: a send whose request had already ended (Ray reported
    its completion first), so the booking is sent and finished at once; ``expired``: bookings a
    replica's report showed ended unheard (``Bookings.apply_stats``)."""

    replicas: list[int] = field(default_factory=list)
    cached: list[CachedTokens] = field(default_factory=list)
    booking: Booking | None = None
    ended: bool = False
    expired: int = 0


class Bookings:
    """The ledger of one live router over ``host`` (see the module docstring).

    ``source``: this router's name in the shared view (its events' keys start with it);
    ``exact``: the host's index is a ``FallbackIndex`` that takes the replicas' KV events;
    ``known``: the unique ids of replicas the host already has, in its order (others are added on
    first sight); ``rids``: the host's request ids, when several ledgers share one load view
    (default: this ledger's own count)."""

    def __init__(self, host: RoutingHost, clock: Clock, wall: Callable[[], float], source: str = "",
                 exact: bool = False, max_tracked: int = MAX_TRACKED,
                 max_awaiting_feedback: int = MAX_AWAITING_FEEDBACK, known: Sequence[str] = (),
                 rids: Iterator[int] | None = None, stale_after_s: float = STALE_AFTER_S) -> None:
        if max_tracked < 1 or max_awaiting_feedback < 1:
            raise ValueError("max_tracked and max_awaiting_feedback must be >= 1")
        if not stale_after_s > 0:
            raise ValueError("stale_after_s must be > 0")
        self.stale_after_s = stale_after_s
        self.host = host
        self.clock = clock
        self.wall = wall
        self.source = source
        self.exact = exact
        self.max_tracked = max_tracked
        self.max_awaiting_feedback = max_awaiting_feedback
        self.names: list[str] = list(known)  # replica index -> unique id
        self.kv_hashes_applied = 0  # hashes of the replicas' KV events applied (exact view)
        self._ids: dict[str, int] = {uid: j for j, uid in enumerate(self.names)}
        self._routed: OrderedDict[str, Booking] = OrderedDict()  # key -> booking, oldest first
        self._done: OrderedDict[str, Booking] = OrderedDict()  # request id -> finished, awaiting feedback
        # key -> a booking that ended before its send was reported (see ``complete``)
        self._ended_unsent: OrderedDict[str, Booking] = OrderedDict()
        self._seen_stats: dict[int, float] = {}  # replica -> the last report's taken_at
        self._rids = itertools.count() if rids is None else rids  # the host's request ids

    # -- lookups -----------------------------------------------------------------------------

    def replica(self, uid: str) -> int:
        """The host's index of replica ``uid``, added to the host on first sight. O(1)."""
        j = self._ids.get(uid)
        if j is None:
            j = self.host.add_replica()
            self._ids[uid] = j
            self.names.append(uid)
        return j

    def index_of(self, uid: str) -> int | None:
        """The index of a replica seen before, else None (nothing is added). O(1)."""
        return self._ids.get(uid)

    def get(self, key: str) -> Booking | None:
        return self._routed.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._routed

    def __len__(self) -> int:
        return len(self._routed)

    def __iter__(self) -> Iterator[str]:
        """The keys of the bookings, oldest first."""
        return iter(self._routed)

    def awaiting_feedback(self, request_id: str) -> bool:
        """Whether ``request_id`` finished and its cached-token report has not come yet."""
        return request_id in self._done

    # -- this router's requests ----------------------------------------------------------------

    def choose(self, key: str, request_id: str, prompt_tokens: int, hashes: Sequence[int],
               replicas: Sequence[int] | None = None, session: str | None = None,
               klass: str = "") -> tuple[Decision, Changes]:
        """Decide for a request among ``replicas`` (default all) and book the pick at once (a burst routed
        concurrently must see each other's bookings). A booking already under ``key`` (a retry
        of the same request) is forgotten first. ``Changes.booking`` is the new booking."""
        changes = self.unbook(key)
        hashes = tuple(hashes)
        rid = next(self._rids)
        d = self.host.decide(rid, prompt_tokens, hashes, replicas=replicas, session=session, klass=klass)
        self._book(rid, key, request_id, d.pick, prompt_tokens, hashes, d.matched_blocks, d.reason,
                   d.best_blocks, self.wall(), changes, klass)
        if d.ranking is not None and d.ranking.expected_s:
            assert changes.booking is not None
            changes.booking.expected_s = d.ranking.expected_s
        return d, changes

    def book(self, key: str, request_id: str, replica: int, prompt_tokens: int, hashes: Sequence[int],
             estimated_blocks: int, reason: str = "choice", best_blocks: int = 0,
             routed_at: float | None = None, klass: str = "") -> Changes:
        """Book a request on ``replica`` without a decision (``routed_at``: default now). Beyond
        ``max_tracked`` bookings the oldest is forgotten."""
        changes = Changes()
        self._book(next(self._rids), key, request_id, replica, prompt_tokens, tuple(hashes), estimated_blocks, reason,
                   best_blocks,
                   self.wall() if routed_at is None else routed_at, changes, klass)
        return changes

    def sent(self, key: str, replica: int, request_id: str, prompt_tokens: int, hashes: Sequence[int],
             klass: str = "") -> Changes:
        """The request was sent to ``replica``: its booking moves there if it was booked
        elsewhere in the rank (or was not booked), is dated now, and the index records the
        prompt there. ``Changes.booking`` is the sent booking. A request whose completion came
        first (``complete`` of an unsent booking on this replica) is not booked again: the send
        dates it and the index records the prompt, and ``Changes.ended`` says it is finished."""
        changes = Changes()
        ended = self._ended_unsent.pop(key, None)
        changes.ended = ended is not None and ended.replica == replica and key not in self._routed
        b = ended if changes.ended else self._routed.get(key)
        if b is None or b.replica != replica:  # sent to another replica of the rank than booked
            reason = b.reason if b is not None else "choice"
            best = b.best_blocks if b is not None else 0
            klass = b.klass if b is not None else klass
            expected = b.expected_s if b is not None else None
            changes.replicas += self.unbook(key).replicas
            hashes = tuple(hashes)
            self._book(next(self._rids), key, request_id, replica, prompt_tokens, hashes,
                       self.host.index.match_one(replica, hashes), reason, best, self.wall(), changes, klass)
            b = changes.booking
            assert b is not None
            b.expected_s = expected
        b.routed_at = self.wall()
        b.sent = True
        if b.expected_s is not None:
            b.expected_ttft_s, b.expected_s = b.expected_s.get(replica, 0.0), None
        self.host.record_routed(replica, b.hashes, b.reason)
        changes.booking = b
        return changes

    def complete(self, key: str, replica: int | None) -> Changes:
        """The request ended on ``replica``: it leaves the load view and awaits its cached-token
        report. A completion from another replica than booked (an earlier attempt, refused and
        routed again) or of an unknown key changes nothing. ``Changes.booking``: the finished
        booking.

        The completion can come before the send is reported: Ray registers its completion
        callback before it awaits the replica's acceptance, and a short request can end in
        between. Such a booking (not yet sent) is remembered, bounded by
        ``max_awaiting_feedback``, so that the late ``sent`` does not book it again: booked again,
        it would count on its replica, here and through the shared view, with no completion to
        come."""
        b = self._routed.get(key)
        if b is None or b.replica != replica:
            return Changes()
        del self._routed[key]
        if not b.sent and not b.remote:
            self._ended_unsent[key] = b
            while len(self._ended_unsent) > self.max_awaiting_feedback:
                self._ended_unsent.popitem(last=False)
        return self._finished(b)

    def unbook(self, key: str) -> Changes:
        """Forget the booking under ``key`` (a retry, a request never sent), if any."""
        b = self._routed.pop(key, None)
        return self._drop(b) if b is not None else Changes()

    def unbook_unsent(self, key: str, booked: Booking) -> Changes:
        """Forget ``booked`` if it is still the booking under ``key`` and was never sent: its
        caller left before the send (Ray reports neither routing nor completion then). O(1)."""
        if self._routed.get(key) is booked and not booked.sent:
            return self.unbook(key)
        return Changes()

    def replica_died(self, uid: str) -> None:
        """Replica ``uid``'s actor died: the index forgets its blocks."""
        j = self._ids.get(uid)
        if j is not None:
            self.host.index.clear_replica(j)

    # -- the replicas' reports -----------------------------------------------------------------

    def apply_stats(self, replica: int, stats: ReplicaRoutingStats) -> Changes:
        """A replica's routing stats (each report once: a repeat of the same ``taken_at`` is
        ignored). Capacity, KV usage and drain rate go to the index and load view; this router's
        requests booked before ``taken_at`` that left the replica's queue are started (dated from
        their admission if still prefilling; past their prefill otherwise); the finished
        requests' cached tokens correct the index.

        Reconciliation: a booking on this replica routed more than ``stale_after_s`` before
        ``taken`` that the report lists nowhere (not waiting, not admitted, not recently
        finished) ended without this router hearing of it (a lost or misordered completion,
        another router's finish that never came): it leaves the load view, so a leak heals
        within ``stale_after_s`` and a report period instead of skewing the replica's load until
        the router restarts. Only with ``admitted_ids`` reported. O(tracked requests + the
        report's lists)."""
        taken = float(stats.taken_at)
        if not taken or self._seen_stats.get(replica) == taken:
            return Changes()
        self._seen_stats[replica] = taken
        host, load = self.host, self.host.load
        if stats.kv_blocks_total > 0:
            host.index.set_capacity(replica, stats.kv_blocks_total)
        load.report_max_running(replica, max(0, int(stats.max_num_seqs)))
        load.report_kv_usage(replica, min(1.0, max(0.0, float(stats.kv_usage))))
        load.report_speed(replica, min(SPEED_RANGE[1], max(SPEED_RANGE[0], float(stats.drain_rate))))
        waiting = set(stats.waiting_ids)
        # Wall times from the replica, on the load view's clock. A request missing from the
        # waiting list started before ``taken``: at its admission time if the replica lists it
        # as prefilling. One that started and is not prefilling has its first token: its prefill
        # no longer delays anyone.
        wall_to_clock = self.clock.now() - self.wall()
        started_by = wall_to_clock + taken
        prefilling = stats.prefilling
        # a request in none of the replica's lists had not reached it at ``taken`` (still in
        # transit from this router): it stays queued, or a burst would look already served
        seen = None if stats.admitted_ids is None else set(stats.admitted_ids) | set(stats.recent_cached)
        stale: list[str] = []
        for key, b in self._routed.items():
            if b.replica != replica or b.routed_at >= taken or b.request_id in waiting or b.rid not in load:
                continue
            if seen is not None and b.request_id not in seen:
                if taken - b.routed_at > self.stale_after_s:
                    stale.append(key)
                continue
            admitted = prefilling.get(b.request_id)
            if not b.started:
                b.started = True
                host.on_started(b.rid, started_at=started_by if admitted is None else wall_to_clock + admitted)
            if admitted is None:
                load.on_prefill_done(b.rid)
        changes = Changes(expired=len(stale))
        for key in stale:  # ended unheard: no cached-token report will come for it
            b = self._routed.pop(key)
            self.host.on_finished(b.rid)
            self.host.release(b.replica, b.hashes)
        for request_id, got in stats.recent_cached.items():
            changes.cached += self.report_cached(request_id, replica, int(got)).cached
        changes.replicas.append(replica)
        return changes

    def report_cached(self, request_id: str, replica: int, cached_tokens: int) -> Changes:
        """The cached tokens a finished request got on ``replica`` (< 0: none, it failed): the
        index is corrected (or, without a report, stops counting the prompt as in flight), and a
        report on this router's own request is counted. A request not awaiting its report, or
        finished on another replica, changes nothing (the latter is forgotten). O(prompt blocks)."""
        b = self._done.pop(request_id, None)
        if b is None or b.replica != replica:
            return Changes()
        if cached_tokens < 0:
            self.host.release(replica, b.hashes)
            return Changes()
        self.host.feedback(replica, b.hashes, cached_tokens, b.estimated_blocks)
        if b.remote:
            return Changes()
        return Changes(cached=[CachedTokens(replica, b.estimated_blocks * self.host.block_size, cached_tokens,
                                            b.prompt_tokens)])

    # -- a host that hears each request's life (the simulator's engines) -----------------------

    def started(self, key: str, started_at: float | None = None) -> None:
        """The booked request under ``key`` left its replica's queue (at ``started_at`` on the
        clock, default now). O(log queued)."""
        b = self._routed.get(key)
        if b is not None:
            b.started = True
            self.host.on_started(b.rid, started_at=started_at)

    def first_token(self, key: str) -> None:
        """The booked request under ``key`` has its first token. O(log queued)."""
        b = self._routed.get(key)
        if b is not None:
            self.host.on_first_token(b.rid)

    def preempted(self, key: str, prompt_tokens: int) -> None:
        """The engine preempted the request under ``key``: its ``prompt_tokens`` of prefill are
        queued again. O(log queued)."""
        b = self._routed.get(key)
        if b is not None:
            b.started = False
            self.host.on_preempted(b.rid, prompt_tokens)

    # -- the shared view -----------------------------------------------------------------------

    def shared_key(self, b: Booking) -> str:
        """The key of this router's booking ``b`` in the shared view (another router books it
        under ``REMOTE`` + this key)."""
        return f"{self.source}:{b.rid}"

    def routed_event(self, b: Booking) -> RequestRouted:
        """The shared view's event for this router's sent booking ``b``."""
        return RequestRouted(self.names[b.replica], self.shared_key(b), b.hashes, b.prompt_tokens,
                             b.estimated_blocks, b.request_id, b.routed_at, b.best_blocks, b.klass)

    def finished_event(self, b: Booking) -> RequestFinished:
        """The shared view's event for this router's completed booking ``b``."""
        return RequestFinished(self.shared_key(b))

    def apply_snapshot(self, kv: dict[str, list[int]], host_only: dict[str, list[int]] | None = None) -> None:
        """The hub's snapshot of every replica's blocks (and host-only blocks, for replicas
        holding some): the exact index takes them whole. O(blocks in the snapshot)."""
        host_only = host_only or {}
        for uid, hashes in kv.items():
            self.host.index.replace_blocks(self.replica(uid), hashes, host_only.get(uid, ()))

    def apply_remote(self, event: Event) -> Changes:
        """One event of the shared view (see ``fairway/routing/view_log.py``): another router's
        ``RequestRouted`` is adopted (the host learns its prompt and queued work, the policy's
        statistics count it) and its ``RequestFinished`` ends it here too; a replica's KV events
        reach the exact index (exact view only); a ``SourceGone`` router's requests in flight
        leave the load view, a gone replica's blocks the exact index. O(1) plus the host's work,
        O(tracked requests) for a gone router."""
        if isinstance(event, RequestRouted):
            key = REMOTE + event.key
            if key in self._routed:  # a batch sent twice (its first exchange timed out)
                return Changes()
            j = self.replica(event.replica)
            rid = next(self._rids)
            self.host.adopt(rid, j, event.hashes, event.prompt_tokens, event.estimated_blocks, event.best_blocks,
                            event.klass)
            changes = Changes()
            self._track(key, Booking(rid, event.request_id, j, tuple(event.hashes), event.estimated_blocks,
                                     event.prompt_tokens, event.routed_at, remote=True, klass=event.klass), changes)
            changes.replicas.append(j)
            return changes
        if isinstance(event, RequestFinished):
            b = self._routed.pop(REMOTE + event.key, None)
            return self._finished(b) if b is not None else Changes()
        if isinstance(event, SourceGone):
            if event.source.startswith(REPLICA_SOURCE):
                j = self._ids.get(event.source[len(REPLICA_SOURCE):])
                if self.exact and j is not None:
                    self.host.index.replace_blocks(j, ())
                return Changes()
            changes = Changes()
            if event.source != self.source:  # a router died: drop what it had in flight
                prefix = f"{REMOTE}{event.source}:"
                for key in [k for k in self._routed if k.startswith(prefix)]:
                    changes.replicas += self._drop(self._routed.pop(key)).replicas
            return changes
        if not self.exact:  # the replicas' KV events: the exact view only
            return Changes()
        index = self.host.index
        if isinstance(event, KvDelta):
            index.on_kv_events(self.replica(event.replica), _as_events(event.stored, event.removed))
        elif isinstance(event, TierDelta):
            index.on_tier_events(self.replica(event.replica), _as_events(event.host_only, event.back))
        elif isinstance(event, KvFull):
            index.replace_blocks(self.replica(event.replica), event.hashes, event.host_only)
        else:  # not an event of this release: ignored, as the view degrades rather than stops
            return Changes()
        self.kv_hashes_applied += event.hash_count
        return Changes()

    # -- internals -----------------------------------------------------------------------------

    def _book(self, rid: int, key: str, request_id: str, replica: int, prompt_tokens: int, hashes: tuple[int, ...],
              estimated_blocks: int, reason: str, best_blocks: int, routed_at: float, changes: Changes,
              klass: str = "") -> None:
        self._ended_unsent.pop(key, None)  # a new attempt: an earlier one's end is not its end
        self.host.book(rid, replica, prompt_tokens, estimated_blocks, hashes, klass)
        b = Booking(rid, request_id, replica, hashes, estimated_blocks, prompt_tokens, routed_at, reason=reason,
                    best_blocks=max(best_blocks, estimated_blocks), klass=klass)
        self._track(key, b, changes)
        changes.replicas.append(replica)
        changes.booking = b

    def _track(self, key: str, b: Booking, changes: Changes) -> None:
        """Keep ``b`` until it completes; beyond ``max_tracked`` the oldest (booked or adopted,
        never completed) is forgotten."""
        self._routed[key] = b
        while len(self._routed) > self.max_tracked:
            _, old = self._routed.popitem(last=False)
            changes.replicas += self._drop(old).replicas

    def _drop(self, b: Booking) -> Changes:
        """Forget a booking that will never complete here (not sent, evicted, its router gone);
        the index stops counting a sent one in flight."""
        self.host.unbook(b.rid)
        if b.sent or b.remote:  # no report to come; its prompt is likely computed there
            self.host.feedback(b.replica, b.hashes, 0, None)
        return Changes([b.replica])

    def _finished(self, b: Booking) -> Changes:
        self.host.on_finished(b.rid)
        self._done[b.request_id] = b
        while len(self._done) > self.max_awaiting_feedback:  # finished, its report lost: likely computed
            _, old = self._done.popitem(last=False)
            self.host.feedback(old.replica, old.hashes, 0, None)
        return Changes([b.replica], booking=b)


def _as_events(on: Sequence[int], off: Sequence[int]) -> Iterator[tuple[bool, int]]:
    """A replica's batch (stored / removed, or host-only / back) as the index's (flag, hash)
    events: the False ones first (a batch holds one event per hash, so the order only matters
    across hashes, where it does not). O(1) each."""
    for h in off:
        yield False, h
    for h in on:
        yield True, h
