"""The router-policy interface: one request and the replicas' states in, ranked replicas out.

A router policy answers one question: where should this request go? It returns a ``Ranking``:
ranks in the shape of Ray Serve's ``RequestRouter.choose_replicas`` (docs/design.md, Ray Serve),
a list of ranks, each a list of replica ids, the first rank preferred, with the decision's reason
and, where the policy computes them, its scores and expected waits. It never awaits, never does I/O and
never reads the wall clock (docs/design.md, Decisions as data; Injected clock and RNG): the host
builds the ``ReplicaState`` list from its prefix index (``fairway/prefix_index.py``) and load view
(``fairway/load_view.py``), calls ``rank``, routes, and then tells the index and the load view
what it did.

Rank conventions (every policy here):

- every candidate replica appears exactly once across the ranks, and no rank is empty;
- ``ranks[0][0]`` is the policy's choice, for hosts that do not probe queues (the simulator);
- the first rank holds only the choice, except where the original system leaves the pick among
  a set to the framework's shortest-queue rule (``pow2``'s two candidates, ``ray-prefix``'s
  matched or smallest-tree set): then the set is the first rank, in the policy's preference
  order. Ray picks the shortest queue within a rank, which is what those systems do;
- every other replica gets a rank of its own, in the policy's preference order, so a framework
  that falls through ranks (Ray does when a rank's replicas are full) keeps that order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.load_view import LoadSnapshot

if TYPE_CHECKING:
    from fairway.policies.classes import ClassesConfig


@dataclass(slots=True)
class RouteRequest:
    """A request as a router policy sees it.

    ``block_hashes`` are the chained hashes of the prompt's full blocks (not the output's);
    ``session`` is the conversation or user the request
    belongs to, when the client or the workload names one (the routing key of session-affinity
    routers), else None; ``objective_s`` its class's TTFT objective when the host gives the
    class view (``RouterPolicy.class_view``), else 0.0.
    """

    rid: int
    prompt_tokens: int
    block_hashes: Sequence[int]
    session: str | None = None
    objective_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClassView:
    """A replica's queue as a request of one class sees it, where the gate orders by class.

    queued_s, queued: its own class's waiting prefill seconds and their estimates, ascending.
    ahead_s: the other classes' queued prefill seconds the gate serves before it
    (``ClassesConfig.others_ahead_s``: stricter tiers whole, same-tier classes' fair share).
    """

    queued_s: float
    queued: tuple[float, ...]
    ahead_s: float


@dataclass(slots=True)
class ReplicaState:
    """One candidate replica as the router sees it (possibly stale, see ``LoadView``).

    Invariants: ``0 <= running <= outstanding``; ``queued_prefill_s >= 0``;
    ``0 <= kv_usage <= 1``; ``0 <= matched_blocks``; ``0 <= index_blocks``.

    replica: the replica's id.
    outstanding: requests routed there and not finished (its queue length, for Ray and SGLang).
    running: requests started in its engine and not finished.
    queued_prefill_s: Q_j, estimated prefill seconds routed there and not yet started.
    kv_usage: fraction of its KV blocks in use, from its stats.
    matched_blocks: the request's estimated cached prefix there, in blocks (from the index).
    index_blocks: blocks the prefix index holds for it (the "tree size" of Ray and SGLang).
    queued_prefill_tokens: uncached prompt tokens routed there and not yet started (Dynamo).
    active_blocks: KV blocks of its outstanding requests (Dynamo's decode blocks).
    queued_prefills: the prefill estimates of its requests waiting to start, ascending (the
        Fairway router's queue-order wait model; empty when the host does not track them).
    max_running: its sequence capacity (the engine's max_num_seqs), 0 when unknown.
    prefill_ends: estimated prefill end times (clock seconds) of its started requests still
        prefilling when the load was read (empty when the host does not track them).
    routed_since, routed_prefills: its recent routed work: the prefill estimates (ascending) of
        the requests routed to it since ``routed_since`` (clock seconds), the routing time of the
        one before them (``LoadView``'s window); empty when the host does not track it.
    host_blocks: of ``matched_blocks``, how many are host hits (the tail of the match from its
        first block held only in the engine's host KV tier: a reload, not a recompute); 0 when
        the index has no tier information or the policy does not ask for it
        (``RouterPolicy.host_tier``). ``0 <= host_blocks <= matched_blocks``.
    speed: the replica's measured pace, cost-model seconds of queued prefill it works off per
        wall second (its gate's drain rate, ``replicas/drain.py``); 1.0 when unknown (the
        simulator's replicas run at the cost model's pace). ``speed > 0``.
    active_prefill_tokens: uncached prompt tokens routed there whose first token has not been
        reported (llm-d's in-flight token load: held from routing to the first token).
    unique_active_blocks: distinct prompt blocks of its outstanding requests (Dynamo's active
        blocks, shared prefixes counted once); 0 when the host does not track them.
    new_blocks: of this request's prompt blocks, how many are not already active there (after
        the longest prefix of the prompt that an outstanding request there holds); None when the
        host does not track active blocks (``RouterPolicy.active_blocks``).
        ``0 <= new_blocks <= len(block_hashes)``.
    class_view: with request classes and a policy that asks (``RouterPolicy.class_view``), the
        queue as the request's class sees it there (``ClassView``); None otherwise.
    """

    replica: int
    outstanding: int
    running: int
    queued_prefill_s: float
    kv_usage: float
    matched_blocks: int
    index_blocks: int
    queued_prefill_tokens: int = 0
    active_blocks: int = 0
    queued_prefills: tuple[float, ...] = ()
    max_running: int = 0
    prefill_ends: tuple[float, ...] = ()
    routed_since: float = 0.0
    routed_prefills: tuple[float, ...] = ()
    host_blocks: int = 0
    speed: float = 1.0
    active_prefill_tokens: int = 0
    unique_active_blocks: int = 0
    new_blocks: int | None = None
    class_view: ClassView | None = None


@dataclass(frozen=True, slots=True)
class Ranking:
    """A router policy's whole answer for one request (docs/design.md, Decisions as data).

    ranks: replica ids, first rank preferred (the module's conventions: every candidate exactly
        once across the ranks, no rank empty; ``ranks[0][0]`` is the policy's choice).
    reason: why the choice was made, a low-cardinality label (the "routing decisions by reason"
        metric); "" when the policy gives none (hosts then count it as "choice").
    scores: replica id -> the score or cost the policy compared, for the policies that score
        replicas (the Fairway router: its expected TTFT T_rj); empty otherwise.
    waits: replica id -> the expected wait W_rj, for the policies that model one (the Fairway
        router); empty otherwise.
    expected_s: replica id -> the expected time from routing to the first token there, for the
        policies that predict one (the Fairway router: the wait and the first step, without the
        terms that only price a placement); empty otherwise. Hosts report how far off it was
        (``fairway_router_ttft_model_ratio``).
    """

    ranks: list[list[int]]
    reason: str
    scores: Mapping[int, float] = field(default_factory=dict)
    waits: Mapping[int, float] = field(default_factory=dict)
    expected_s: Mapping[int, float] = field(default_factory=dict)


class RouterPolicy(ABC):
    """Base class of every router policy.

    Subclasses take their options as keyword arguments after ``rng`` (the anchors' defaults:
    docs/design.md, Anchors) and implement ``rank``, which returns a ``Ranking``: the ranks, the
    reason and, where they score replicas, the scores (replica id -> the score or cost they
    compared).

    ``rank`` is pure (no I/O, no awaits, no wall clock: docs/design.md, Decisions as data). It may
    advance the policy's own state: the round-robin counter and the injected ``rng``.
    """

    name: ClassVar[str] = "base"
    #: the prefix index a host builds for this policy when its user names none (the simulator's
    #: ``--index-mode``): "approx" (the router's own decisions) or "events" (the engines' KV events)
    default_index_mode: ClassVar[str] = "approx"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        **options: object,
    ) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options: {', '.join(sorted(options))}")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.clock = clock
        self.cost = cost
        self.block_size = block_size
        self.rng = rng if rng is not None else np.random.default_rng(0)
        # whether ``rank`` reads ``ReplicaState.host_blocks``: the host then asks the index for
        # the tier split (``PrefixIndex.match_tiers``); the others count both tiers as hits
        self.host_tier = False
        # whether ``rank`` reads ``ReplicaState.active_prefill_tokens`` released at the first
        # token: the host then reports first tokens to the load view (``LoadView.on_first_token``)
        self.first_tokens = False
        # whether ``rank`` reads ``ReplicaState.unique_active_blocks`` and ``new_blocks``: the host
        # then tracks each replica's active prompt blocks (``LoadView.track_blocks``, O(prompt
        # blocks) per request)
        self.active_blocks = False
        # whether ``rank`` reads a request's class's queue (``ReplicaState.class_view``) and
        # objective (``RouteRequest.objective_s``): the host then gives them with classes
        self.class_view = False
        # the engine's prefill chunk (``prefill_time``); 0: a prompt is priced as one pass
        self.prefill_chunk = 0

    @abstractmethod
    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        """Ranked replica ids for ``req`` among ``states`` (see the module's conventions), with
        the reason and any scores and waits."""

    def on_adopted(self, hashes: Sequence[int], matched_blocks: int, prompt_tokens: int) -> None:
        """Another router instance routed a request of ``prompt_tokens`` tokens (``hashes``), whose
        longest match among the candidates was ``matched_blocks`` (a shared view): a policy that
        keeps its own statistics of the traffic learns of it. Default: nothing. O(1)."""
        return None

    # -- helpers shared by the policies -----------------------------------------------------

    def cached_tokens(self, req: RouteRequest, s: ReplicaState) -> int:
        """Estimated cached tokens of ``req`` on ``s``: its matched blocks, capped at the
        cacheable prefix (the engine always computes the last prompt token, as vLLM does)."""
        cacheable = max(0, (req.prompt_tokens - 1) // self.block_size)
        return min(s.matched_blocks, cacheable) * self.block_size

    def host_tokens(self, req: RouteRequest, s: ReplicaState) -> int:
        """Of ``cached_tokens(req, s)``, the tokens in the host tier (a reload): the cached
        prefix beyond its GPU part, ``matched_blocks - host_blocks`` blocks. O(1)."""
        if not s.host_blocks:
            return 0
        return max(0, self.cached_tokens(req, s) - (s.matched_blocks - s.host_blocks) * self.block_size)

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """The prefill estimate this policy prices with, and its host books into the load view:
        the cost model's one pass, or, with ``prefill_chunk`` set, the engine's steps of that
        many tokens each (``CostModel.chunked_prefill_time``). O(new_tokens / prefill_chunk)."""
        if 0 < self.prefill_chunk < new_tokens:
            return self.cost.chunked_prefill_time(new_tokens, cached_tokens, self.prefill_chunk)
        return self.cost.prefill_time(new_tokens, cached_tokens)

    def prefill_s(self, req: RouteRequest, s: ReplicaState) -> float:
        """P_rj: the policy's prefill estimate (``prefill_time``) of ``req``'s uncached tokens on
        ``s``."""
        c = self.cached_tokens(req, s)
        return self.prefill_time(req.prompt_tokens - c, c)

    def match_rate(self, req: RouteRequest, s: ReplicaState) -> float:
        """Matched tokens / prompt tokens, in [0, 1]: the match rate Ray and SGLang compare.
        They match characters of the prompt text; we match whole blocks of tokens."""
        if req.prompt_tokens <= 0:
            return 0.0
        return min(1.0, s.matched_blocks * self.block_size / req.prompt_tokens)


def by_id(states: Sequence[ReplicaState]) -> list[ReplicaState]:
    """``states`` sorted by replica id (every policy's deterministic order). Raises on an empty
    or duplicated candidate list. O(R log R)."""
    if not states:
        raise ValueError("no replicas to rank")
    ids = [s.replica for s in states]
    if ids == sorted(set(ids)):  # already in order, no duplicate (the hosts' usual list): C-level checks
        return list(states)
    ss = sorted(states, key=lambda s: s.replica)
    for a, b in zip(ss, ss[1:], strict=False):
        if a.replica == b.replica:
            raise ValueError(f"replica {a.replica} appears twice")
    return ss


def ranks_of(first: Sequence[int], rest: Iterable[int]) -> list[list[int]]:
    """``[list(first), [r1], [r2], ...]``: the first rank, then one rank per other replica."""
    return [list(first)] + [[j] for j in rest]


def choice(ranks: Sequence[Sequence[int]]) -> int:
    """The replica a host that does not probe queues routes to: the first of the first rank."""
    return ranks[0][0]


def make_states(
    snap: LoadSnapshot,
    matched: Sequence[int],
    index_blocks: Sequence[int],
    replicas: Iterable[int] | None = None,
    host: Sequence[int] | None = None,
    new: Sequence[int] | None = None,
    klass: str = "",
    classes: ClassesConfig | None = None,
    views: ClassViews | None = None,
) -> list[ReplicaState]:
    """Build the ``ReplicaState`` list for one request from a load snapshot, the index's
    ``match(hashes)`` and ``sizes()`` (all indexed by replica id), for ``replicas`` (default
    all); ``host``: the host part of each match (``match_tiers``), None for none; ``new``: the
    request's new active blocks per replica (``LoadView.new_blocks``), None when untracked;
    ``klass`` and ``classes``: the request's class and the configured classes, for the class view
    (``ReplicaState.class_view``; none without them); ``views``: the host's memo of the class views
    (``ClassViews``), None to build them afresh. O(R) (times C with classes, for the replicas
    whose class queues changed when given ``views``)."""
    n = len(snap.outstanding)
    ids = range(n) if replicas is None else replicas
    # the optional columns resolved once, not once per replica
    qps = snap.queued_prefills or ((),) * n
    caps = snap.max_running or (0,) * n
    ends = snap.prefill_ends or ((),) * n
    windows = snap.routed_windows or ((0.0, ()),) * n
    hosts = host if host is not None else (0,) * n
    speeds = snap.speed or (1.0,) * n
    ptoks = snap.active_prefill_tokens or (0,) * n
    uniq = snap.unique_active_blocks or (0,) * n
    news: Sequence[int | None] = new if new is not None else (None,) * n
    # positional, in ReplicaState's field order: keyword arguments cost three times as much per
    # state here (16 states: about 11 us of a decision), and tests/fairway/test_load_view.py checks
    # every column lands in its named field
    out, run, qs, kv, qt, ab = (snap.outstanding, snap.running, snap.queued_prefill_s, snap.kv_usage,
                                snap.queued_prefill_tokens, snap.active_blocks)
    states = [
        ReplicaState(j, out[j], run[j], qs[j], kv[j], matched[j], index_blocks[j], qt[j], ab[j], qps[j], caps[j],
                     ends[j], windows[j][0], windows[j][1], hosts[j], speeds[j], ptoks[j], uniq[j], news[j])
        for j in ids
    ]
    if klass and classes is not None and classes.classes and snap.class_queues:
        memo = views if views is not None else ClassViews()
        cq = snap.class_queues
        for s in states:
            s.class_view = memo.view(s.replica, cq[s.replica], klass, classes)
    return states


class ClassViews:
    """The ``ClassView`` each class sees on each replica, kept while that replica's class queues
    are the same object: the load view rebuilds a replica's frozen class queues only when a
    classed request joins or leaves them (``LoadSnapshot.class_queues``), so a decision
    recomputes only the replicas whose queues moved since the last one.

    Why: with classes, building every replica's view on every decision was the largest part of
    building the states. Complexity: O(1) per replica whose queues did not change, O(C) per
    one that did. A host keeps one per router; ``make_states`` without one builds afresh."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Mapping[str, tuple[float, tuple[float, ...]]], dict[str, ClassView]]] = {}

    def view(self, replica: int, queues: Mapping[str, tuple[float, tuple[float, ...]]], klass: str,
             classes: ClassesConfig) -> ClassView:
        """The view of class ``klass`` on ``replica`` whose class queues are ``queues`` (not to be
        mutated: a new object when they change)."""
        memo = self._memo.get(replica)
        if memo is None or memo[0] is not queues:
            memo = self._memo[replica] = (queues, {})
        v = memo[1].get(klass)
        if v is None:
            own_s, own = queues.get(klass, (0.0, ()))
            ahead = classes.others_ahead_s(klass, own_s, {k: q for k, (q, _) in queues.items() if k != klass})
            v = memo[1][klass] = ClassView(own_s, own, ahead)
        return v


__all__ = ["ClassView", "ClassViews", "Ranking", "ReplicaState", "RouteRequest", "RouterPolicy", "by_id", "choice",
           "make_states", "ranks_of"]
