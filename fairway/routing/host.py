"""One router instance: a router policy, its prefix index and its load view, and the bookkeeping
around a decision. The simulator (``sim/cluster.py``) and the Ray Serve request router
(``router/serve_router.py``) both call this class, so a decision is made the same way in both.

Per request: ``decide`` matches the prompt's block hashes against the index, builds the replicas'
states from a load snapshot, lets the policy rank them, and picks within the first rank the
replica with the fewest outstanding requests (ties: the policy's order), as Ray Serve does within
a rank. The host then reports the request's life: ``book`` (its prefill joins the pick's queued
work), ``record_routed`` (the index learns the prompt is on that replica), ``on_started`` /
``on_first_token`` / ``on_preempted`` / ``on_finished`` (the load view), ``feedback`` (the cached tokens the engine
reported correct the index).

Complexity per decision: O(prompt blocks) for the index match (and, for a policy that reads
active blocks, their walk), O(replicas) for the states, plus the policy's rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fairway.load_view import LoadView
from fairway.policies.classes import ClassesConfig
from fairway.prefix_index import APPROX, PrefixIndex
from fairway.routing.base import ClassViews, Ranking, RouteRequest, RouterPolicy, make_states


@dataclass(slots=True)
class Decision:
    """A routing decision. ``ranks`` is the policy's answer (first rank preferred); ``pick`` is in
    ``ranks[0]``; ``matched_blocks`` is the index's match on ``pick``; ``reason`` is the policy's
    ("choice" when it gives none); ``best_blocks`` is the longest match among the candidates (what
    a policy's traffic statistics name the request's prefix by, wherever it was sent);
    ``ranking``: the policy's whole ``Ranking`` (its scores and waits), None when built by hand."""

    ranks: list[list[int]]
    pick: int
    matched_blocks: int
    reason: str
    best_blocks: int = 0
    ranking: Ranking | None = None


class RoutingHost:
    """A router policy with its own prefix index and load view (see the module docstring)."""

    def __init__(self, policy: RouterPolicy, index: PrefixIndex, load: LoadView, block_size: int = 16,
                 feedback: bool = True, classes: ClassesConfig | None = None) -> None:
        """``feedback=False``: an approximate index learns from the router's decisions only, never
        from the engines' cached-token reports (what Ray's, SGLang's, AIBrix's and
        production-stack's routers know: docs/design.md, Anchors). ``classes``: the cluster's
        request classes, for a policy that prices a request's wait on its class's queue
        (``RouterPolicy.class_view``)."""
        self.policy = policy
        self.classes = classes if classes is not None and classes.classes else None
        self.feedback_on = feedback
        self.index = index
        self.load = load
        self.block_size = block_size
        self.reasons: Counter = Counter()  # routing decisions by reason, as recorded
        self._views = ClassViews()  # the class views, per replica, while its class queues stand

    def add_replica(self) -> int:
        """A new replica id in both the index and the load view."""
        j = self.index.add_replica()
        self.load.add_replica()
        return j

    def decide(self, rid: int, prompt_tokens: int, hashes: Sequence[int],
               replicas: Iterable[int] | None = None, session: str | None = None, klass: str = "") -> Decision:
        """Rank ``replicas`` (default all) for a request and pick within the first rank;
        ``session``: the request's session key, if it has one (``RouteRequest.session``);
        ``klass``: its request class ("" without classes)."""
        host = None
        if self.policy.host_tier:  # GPU hit / host hit / miss (events index with host tiers)
            matched, host = self.index.match_tiers(hashes)
        else:
            matched = self.index.match(hashes)
        new = self.load.new_blocks(hashes) if self.policy.active_blocks else None  # Dynamo's decode term
        view = self.classes is not None and self.policy.class_view
        klass = self._class_of(klass) if view else ""
        states = make_states(self.load.snapshot(), matched, self.index.sizes(), replicas=replicas, host=host,
                             new=new, klass=klass, classes=self.classes, views=self._views)
        objective = self.classes.spec(klass).objective_s if klass and self.classes is not None else 0.0
        ranking = self.policy.rank(RouteRequest(rid, prompt_tokens, hashes, session=session, objective_s=objective),
                                   states)
        first = ranking.ranks[0]
        out = self.load.outstanding_now()
        pick = first[0] if len(first) == 1 else min(first, key=lambda j: (out[j], first.index(j)))
        best = max(s.matched_blocks for s in states)
        return Decision(ranking.ranks, pick, matched[pick], ranking.reason or "choice", best, ranking)

    def book(self, rid: int, replica: int, prompt_tokens: int, matched_blocks: int,
             hashes: Sequence[int] = (), klass: str = "") -> None:
        """The request's prefill joins ``replica``'s queued work (its matched blocks are cached),
        in its class's queue with classes; a policy that reads active blocks gets its prompt
        ``hashes`` tracked there. Its prefill is booked at the policy's own estimate
        (``RouterPolicy.prefill_time``)."""
        c = max(0, min(matched_blocks * self.block_size, prompt_tokens - 1))
        self.load.on_routed(rid, replica, prompt_tokens, c, prefill_s=self.policy.prefill_time(prompt_tokens - c, c),
                            klass=self._class_of(klass))
        if self.policy.active_blocks:
            self.load.track_blocks(rid, hashes)

    def _class_of(self, klass: str) -> str:
        """The class a booking is queued under: ``klass`` resolved ("" = the default class) with
        classes, "" without them or for a class this host does not know (an event from a router
        configured otherwise). O(C)."""
        if self.classes is None:
            return ""
        try:
            return self.classes.resolve(klass)
        except ValueError:
            return ""

    def unbook(self, rid: int) -> None:
        """Forget a booked request (a retry, or one that was never sent)."""
        if rid in self.load:
            self.load.on_finished(rid)

    def record_routed(self, replica: int, hashes: Sequence[int], reason: str) -> None:
        """The request was sent to ``replica``: its prompt's blocks will be cached there."""
        self.reasons[reason] += 1
        self.index.record_routed(replica, hashes)

    def adopt(self, rid: int, replica: int, hashes: Sequence[int], prompt_tokens: int, matched_blocks: int,
              best_blocks: int | None = None, klass: str = "") -> None:
        """Another router instance sent this request to ``replica`` (a shared view): the index
        and the load view learn it as if routed here (``matched_blocks`` cached there), and the
        policy's own traffic statistics count it (``RouterPolicy.on_adopted``) under the
        decision's longest match, ``best_blocks`` (default: ``matched_blocks``), as they count
        the policy's own decisions; it is not one of this policy's decisions."""
        self.index.record_routed(replica, hashes)
        self.book(rid, replica, prompt_tokens, matched_blocks, hashes, klass)
        self.policy.on_adopted(hashes, matched_blocks if best_blocks is None else best_blocks, prompt_tokens)

    def finished(self, rid: int, replica: int, hashes: Sequence[int], cached_tokens: int,
                 estimated_blocks: int | None) -> None:
        """The request ended: it leaves the load view, and the index takes the engine's
        cached-token report (``cached_tokens`` < 0: none, the request failed)."""
        self.on_finished(rid)
        if cached_tokens >= 0:
            self.feedback(replica, hashes, cached_tokens, estimated_blocks)
        else:
            self.release(replica, hashes)

    def on_started(self, rid: int, started_at: float | None = None) -> None:
        if rid in self.load:
            self.load.on_started(rid, started_at=started_at)

    def on_first_token(self, rid: int) -> None:
        """The request's first token came: only a policy that reads tokens held until the first
        token hears it (``RouterPolicy.first_tokens``; the others' view stays as it was without
        this report)."""
        if self.policy.first_tokens and rid in self.load:
            self.load.on_first_token(rid)

    def on_preempted(self, rid: int, prompt_tokens: int) -> None:
        if rid in self.load:
            self.load.on_preempted(rid, 0, prompt_tokens, prefill_s=self.policy.prefill_time(max(1, prompt_tokens), 0))

    def on_finished(self, rid: int) -> None:
        if rid in self.load:
            self.load.on_finished(rid)

    def release(self, replica: int, hashes: Sequence[int]) -> None:
        """A request ended without a cached-token report (rejected, failed, report lost): an
        exact index stops counting its blocks as in flight."""
        self.index.release(replica, hashes)

    def feedback(self, replica: int, hashes: Sequence[int], cached_tokens: int, estimated_blocks: int | None) -> None:
        """The engine reported ``cached_tokens`` for a prompt the index estimated at
        ``estimated_blocks`` on ``replica``: the index corrects itself (an exact index only
        releases the request's blocks from flight; with ``feedback`` off, an approximate one
        ignores the report)."""
        if not self.feedback_on and self.index.mode == APPROX:
            return
        self.index.on_feedback(replica, hashes, cached_tokens, self.block_size, estimated_blocks)
