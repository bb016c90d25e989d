"""Fairway's replica choice: the minimum expected TTFT. The model, its reasons and options are
stated once, in docs/design.md, Fairway router.

Rule: rank replica j for request r by T_rj = (W_rj + S_rj + footprint_weight * P_rj *
fullness_j + overtake_weight * P_rj * N_rj) / s_j + reload_rj (+ extra_work_weight * (P_rj -
min_j P_rj)) (+ delay_weight * D_rj) and pick the minimum, unless hot-prefix replication seeds
a non-holder (``replicate``);
``rule="affinity"`` keeps the reference design's test instead; ``sticky_match`` (off by default)
keeps a request on a replica that holds most of its prompt while that costs at most
``sticky_slack`` cold prefills of T.

Terms: ĉ_rj the estimated cached tokens (matched blocks, capped at the cacheable prefix); P_rj
the prefill of L_r - ĉ_rj tokens on ĉ_rj, in the engine's chunks (``prefill_chunk``,
``RouterPolicy.prefill_time``); Q_j the prefill seconds routed to j and not yet started;
R_j the prefill still to run of the requests j has started (``running_prefill``); W_rj the wait
(``expected_wait``: R_j + min(Q_j, A_rj / fast_share) with a hit on j, A_rj the queued work no
heavier than P_rj, whether or not j has a free sequence slot; R_j + Q_j with
``wait_model="fcfs"``; cold: ``overtaken_wait``); S_rj the first-token step with j's decodes
(``decode_batch``); N_rj the requests waiting on j heavier than P_rj, which the request passes
and delays by P_rj each; fullness_j per ``footprint``; reload_rj the host-tier hits' reload
(``host_tier``); s_j the measured pace (``speed_aware``, else 1). With request classes
(``class_view``): while some replica's T_rj (without the N_rj term) meets the request's class's
objective, nothing changes (the whole queue keeps the cluster balanced for every class); when
none does, W_rj is priced on the queue its class sees (``class_wait``: Q_j and A_rj its class's,
plus the other classes' work its gate serves first), so an interactive request behind a batch
flood is placed by the interactive work ahead of it.

Ranks: the pick, then the others by T (ties: more cache, fewer outstanding, smaller index, lower
id). The ``Ranking``'s reason: ``"replicate"``, ``"cold"``, ``"affinity"`` (the pick is
best-cached) or ``"fair"``; its scores are each T_rj, its waits each W_rj.

Complexity: O(R log R + n + k + R W) for R candidates, n requests waiting across them, k started
requests still prefilling and W = 31 routed estimates per replica; two cost-model calls per
replica.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from fairway.clock import Clock
from fairway.cost_model import CostModel, reload_s_per_token
from fairway.engine.model import DEFAULT_MAX_NUM_BATCHED_TOKENS
from fairway.policies.fairway import FairwayConfig
from fairway.routing.base import Ranking, ReplicaState, RouteRequest, RouterPolicy, by_id, ranks_of
from fairway.routing.popularity import PrefixShares

#: The replica queue's default promotion threshold.
DEFAULT_THETA = FairwayConfig().theta
#: The load at which ``arrivals_delay`` stops growing: at or past it a replica's busy period
#: does not end, and 1 / (1 - rho) would price every placement there without bound.
MAX_DELAY_LOAD = 0.95
#: The Fast lane's guaranteed share of prefill at a Fairway replica under contention.
DEFAULT_FAST_SHARE = 1.0 - FairwayConfig().fair_share


@dataclass(frozen=True, slots=True)
class FairwayRouterConfig:
    """The Fairway router's options, validated once (an error names the option).

    - wait_model = "queue" ("fcfs": W = R_j + Q_j, for FCFS replicas; hosts set it from the
      replica policy, ``queue_model_options``); fast_share = 0.4 (1 - the replicas' fair_share).
    - rule = "score" (the minimum T_rj) or "affinity" (the reference design's test, see the
      module docstring). theta = 12 (the queue level's default; hosts pass the replicas' own)
      also caps the overtaken wait; p_floor_s = 0 applies to "affinity" only.
    - affinity_ties = "ttft" (rule="affinity" only, for an equal best match and equal W: the
      better T, then fewer outstanding; "id": the lowest id; "hash": the rendezvous-hash winner
      for the prompt's first block after the match; "kv": the lowest KV usage, then the better T).
    - footprint_weight = 1, footprint = "kv" (fullness = KV usage over the highest replica's;
      "index": index blocks over the largest index; "kv-abs": the KV usage itself, so the term
      fades when memory is idle); footprint_floor = 0 ("kv" only: over the highest usage or the
      floor, whichever is larger, so a sliver of memory in use does not read as full; 1 is
      "kv-abs").
    - extra_work_weight = 0 (w > 0 adds w * (P_rj - min_j P_rj) to T_rj: the prefill a placement
      adds beyond the cheapest one).
    - overtake_weight = 1 (k adds k * P_rj * N_rj: the wait the placement adds to the N_rj
      requests waiting on j with more prefill than P_rj, which the Fast lane passes; with 1 the
      rank is the placement's increase of the sum of first-token times; 0: the rule before
      2026-12-06, the request's own T alone). Not with ``wait_model="fcfs"`` (nobody is
      passed), nor on the class view's pricing (a class passes the lower tiers by design).
    - delay_weight = 0 (k > 0 adds k * D_rj, ``arrivals_delay``: the delay the placement's
      prefill adds to the requests that reach j while j's backlog drains; it vanishes on an
      idle cluster and grows in a burst, where a placement that recomputes a prefix delays
      everyone queued behind it).
    - running_prefill, decode_batch, replicate, overtaking = True: the R_j term, the first-token
      step priced with j's running decodes, hot-prefix replication, the overtaken cold wait.
    - seed_footprint = False: replication compares the T's without their footprint terms
      (``_seed_target``): KV usage is not a wait, and since the footprint normalizes it by the
      fullest replica's, a holder's stale usage alone on an idle cluster doubled its T and
      copied the prefix. True compares them with it (the rule before 2026-12-05; every
      yardstick run is the same with either).
    - prefill_chunk = 8,192 (the engine's default token budget per step): P_rj and the prefill
      booked into the load view (hence Q_j and R_j) are a chunked-prefill engine's time for the
      prompt, one step per chunk of at most this many tokens
      (``CostModel.chunked_prefill_time``); hosts pass the replicas' own (their budget, or their
      ``long_prefill_token_threshold`` where lower). 0 prices a prompt as one pass (the rule
      before 2026-12-07), which underestimates a prompt of many chunks (by 1.3x at 191k tokens)
      so the router saw a replica free while its long prefill still ran (docs/design.md, A
      prompt of many chunks).
    - sticky_match = 0 (off), sticky_slack = 3: with m > 0, a request that some replica caches at
      least m of (a continuation) stays on the best-T such replica unless its T is more than
      sticky_slack times the request's cold prefill above the minimum T, so a conversation's
      context is not copied to a replica whose queue is only a little shorter.
    - fcfs_when_full = False: True prices a replica whose sequence slots are all taken as FCFS
      (W_rj = R_j + Q_j), the model before 2026-12-04. A full Fairway replica still admits in
      its queue's order at each finish, so the queue model holds there too; pricing it as FCFS
      sent cached requests off their replica in bursts (docs/design.md, Wait model).
    - class_view = True: with request classes, a request that no replica serves within its
      class's objective by the whole queue is placed by the queue its class sees
      (``class_wait``; module docstring).
    - speed_aware = True: divides T_rj by the replica's measured speed (module docstring), so a
      replica that works off its queue slower than the cost model says (a slower GPU, a noisy
      neighbour, a wrong profile) gets less. The rate is learned while requests wait at the
      replica and returns to the cost model's while none does (``replicas/drain.py``), so a rate
      learned under a heavy mix does not skew a later burst. The simulator's replicas report no
      speed (1.0), where on and off decide the same to the bit.
    - host_tier = True (price a host-tier hit as a reload; the host asks the index for the tier
      split), host_link_bytes_per_s = 50e9 (the engines' host-to-GPU copy bandwidth, as
      ``EngineConfig``'s default; checked with the cost model by ``reload_s_per_token``). Without
      tier information (approx index, no host tier) the reload term is 0 and the decisions are
      those of ``host_tier=False``.
    """

    theta: float = DEFAULT_THETA
    p_floor_s: float = 0.0
    extra_work_weight: float = 0.0
    footprint_weight: float = 1.0
    footprint: str = "kv"
    footprint_floor: float = 0.0
    affinity_ties: str = "ttft"
    wait_model: str = "queue"
    fast_share: float = DEFAULT_FAST_SHARE
    rule: str = "score"
    running_prefill: bool = True
    decode_batch: bool = True
    replicate: bool = True
    overtaking: bool = True
    host_tier: bool = True
    speed_aware: bool = True
    host_link_bytes_per_s: float = 50e9
    sticky_match: float = 0.0
    sticky_slack: float = 3.0
    class_view: bool = True
    fcfs_when_full: bool = False
    delay_weight: float = 0.0
    overtake_weight: float = 1.0
    seed_footprint: bool = False
    prefill_chunk: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    @property
    def kv_floor(self) -> float:
        """The least a KV footprint divides a replica's usage by (the highest usage when that is
        more): 1 for "kv-abs", which is the usage itself (usages are at most 1), else
        ``footprint_floor``."""
        return 1.0 if self.footprint == "kv-abs" else self.footprint_floor

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError("theta must be > 0")
        if not self.p_floor_s >= 0:
            raise ValueError("p_floor_s must be >= 0")
        if not self.extra_work_weight >= 0:
            raise ValueError("extra_work_weight must be >= 0")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (tokens; 0: one pass), got {self.prefill_chunk!r}")
        if not self.delay_weight >= 0:
            raise ValueError("delay_weight must be >= 0")
        if not self.overtake_weight >= 0:
            raise ValueError("overtake_weight must be >= 0")
        if not 0.0 <= self.sticky_match <= 1.0:
            raise ValueError("sticky_match must be in [0, 1]")
        if not self.sticky_slack >= 0:
            raise ValueError("sticky_slack must be >= 0")
        if not self.footprint_weight >= 0:
            raise ValueError("footprint_weight must be >= 0")
        if self.footprint not in ("index", "kv", "kv-abs"):
            raise ValueError("footprint must be 'index', 'kv' or 'kv-abs'")
        if not 0.0 <= self.footprint_floor <= 1.0:
            raise ValueError("footprint_floor must be in [0, 1]")
        if self.footprint_floor and self.footprint != "kv":
            raise ValueError("footprint_floor applies to footprint='kv' only")
        if self.affinity_ties not in ("id", "ttft", "hash", "kv"):
            raise ValueError("affinity_ties must be 'id', 'ttft', 'hash' or 'kv'")
        if self.wait_model not in ("queue", "fcfs"):
            raise ValueError("wait_model must be 'queue' or 'fcfs'")
        if not 0.0 < self.fast_share <= 1.0:
            raise ValueError("fast_share must be in (0, 1]")
        if self.rule not in ("score", "affinity"):
            raise ValueError("rule must be 'score' or 'affinity'")
        for name in ("host_tier", "speed_aware", "class_view"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")
        for name in ("theta", "p_floor_s", "extra_work_weight", "delay_weight", "overtake_weight", "footprint_weight",
                     "fast_share", "sticky_match", "sticky_slack", "footprint_floor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("running_prefill", "decode_batch", "replicate", "overtaking", "fcfs_when_full", "seed_footprint"):
            object.__setattr__(self, name, bool(getattr(self, name)))


class FairwayRouter(RouterPolicy):
    """``fairway``: the minimum expected TTFT, with the wait modelled on the replica's own queue
    order (see the module docstring). Its options are ``FairwayRouterConfig``'s, given as keyword
    arguments (the registry's way) or as ``config``.

    The defaults minimise the worst case against the best anchor router (docs/benchmarks.md):
    the queue model keeps a mostly cached request on its replica behind a long but heavier
    queue, and R_j and the decode batch stop requests queueing behind a started long prefill or
    a busy decode batch for a few milliseconds of cache.
    """

    name = "fairway"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        rng: np.random.Generator | None = None,
        *,
        config: FairwayRouterConfig | None = None,
        **options: object,
    ):
        super().__init__(clock, cost, block_size, rng)
        if config is not None and options:
            raise TypeError("give FairwayRouter a config or options, not both")
        self.config = cfg = config if config is not None else FairwayRouterConfig(**options)  # type: ignore[arg-type]
        self.host_tier = cfg.host_tier
        self.class_view = cfg.class_view
        # seconds to reload one token's KV from the host tier (the engine model's own rate; the
        # bandwidth is checked there)
        self.reload_s_per_token = reload_s_per_token(cost, cfg.host_link_bytes_per_s)
        self.shares = PrefixShares()
        self.prefill_chunk = cfg.prefill_chunk

    def expected_wait(self, s: ReplicaState, prefill_s: float, cached_tokens: int,
                      queued: tuple[float, tuple[float, ...]] | None = None, now: float | None = None) -> float:
        """W_rj for a request with prefill estimate ``prefill_s`` and ``cached_tokens`` on
        replica ``s`` (see the module docstring); ``queued``: (Q, its sorted estimates) in place
        of the replica's whole queue; ``now``: the clock's time, when the caller has read it.
        O(log n) plus a C-level sum over the n requests waiting there."""
        cfg = self.config
        q, qp = (s.queued_prefill_s, s.queued_prefills) if queued is None else queued
        r = self.running_prefill_s(s, now) if cfg.running_prefill and s.prefill_ends else 0.0
        queue_model = cfg.wait_model == "queue"
        if queue_model and cached_tokens <= 0 and cfg.overtaking:
            return self.overtaken_wait(s, r + q, prefill_s, now)
        slots_full = cfg.fcfs_when_full and s.max_running and s.outstanding >= s.max_running
        if not queue_model or cached_tokens <= 0 or not qp or slots_full:
            return r + q  # the whole queue ahead: FCFS replicas, a cold request, no listed queue
        ahead = sum(qp[: bisect.bisect_right(qp, prefill_s)])
        return r + min(q, ahead / cfg.fast_share)

    def lighter_rate(self, s: ReplicaState, prefill_s: float, now: float | None = None) -> float:
        """rho_rj: prefill seconds per second of the work lighter than ``prefill_s`` routed to
        ``s`` lately (its routed window), 0 while there is no window; ``now`` as
        ``expected_wait``'s. O(log W) for the bisect plus a C-level sum over at most W = 31
        estimates."""
        ps = s.routed_prefills
        if not ps:
            return 0.0
        span = (self.clock.now() if now is None else now) - s.routed_since
        if span <= 0.0:
            return 0.0
        return sum(ps[: bisect.bisect_left(ps, prefill_s)]) / span

    def overtaken_wait(self, s: ReplicaState, ahead_s: float, prefill_s: float, now: float | None = None) -> float:
        """A cold request's wait on ``s`` behind ``ahead_s`` seconds of work: stretched by the
        lighter work that keeps arriving and overtaking it, ahead_s / (1 - rho), until its
        promotion after theta * P: capped at ahead_s + theta * P. O(log W)."""
        bound = ahead_s + self.config.theta * prefill_s
        rho = self.lighter_rate(s, prefill_s, now)
        return min(ahead_s / (1.0 - rho), bound) if rho < 1.0 else bound

    def running_prefill_s(self, s: ReplicaState, now: float | None = None) -> float:
        """R_j: the estimated prefill still to run of the requests already started on ``s``
        (each started at t0 with estimate P ends at t0 + P; the engine schedules running
        prefills before it admits waiting requests); ``now`` as ``expected_wait``'s. O(k) for
        the k listed."""
        if not s.prefill_ends:
            return 0.0
        if now is None:
            now = self.clock.now()
        return sum(e - now for e in s.prefill_ends if e > now)

    def passed_delay(self, s: ReplicaState, prefill_s: float) -> float:
        """overtake_weight * P_rj * N_rj (over the pace with ``speed_aware``): the wait a
        placement of ``prefill_s`` seconds adds to the N_rj requests waiting on ``s`` with more
        prefill, which the Fast lane's order lets it pass (the module docstring's rule).
        O(log n) for the bisect over the n waiting estimates."""
        qp = s.queued_prefills
        d = self.config.overtake_weight * prefill_s * (len(qp) - bisect.bisect_right(qp, prefill_s))
        return d / s.speed if self.config.speed_aware else d

    def arrivals_delay(self, s: ReplicaState, prefill_s: float, now: float | None = None) -> float:
        """D_rj: the delay ``prefill_s`` seconds of prefill placed on ``s`` add to the requests
        that reach ``s`` while its backlog drains (the module docstring's ``delay_weight``
        term): each arrival of the remaining busy period waits ``prefill_s`` longer, and a busy
        period started by work B + P lasts (B + P) / (1 - rho), so D = lambda * P * (B + P) /
        (1 - rho), with lambda and rho the request rate and prefill load routed to ``s`` lately
        (its routed window; rho capped at 0.95, where the busy period no longer ends) and B =
        R_j + Q_j. 0 while there is no window. O(k + W)."""
        ps = s.routed_prefills
        if not ps:
            return 0.0
        if now is None:
            now = self.clock.now()
        span = now - s.routed_since
        if span <= 0.0:
            return 0.0
        rho = min(sum(ps) / span, MAX_DELAY_LOAD)
        backlog = s.queued_prefill_s + self.running_prefill_s(s, now)
        return len(ps) / span * prefill_s * (backlog + prefill_s) / (1.0 - rho)

    def reload_s(self, req: RouteRequest, s: ReplicaState) -> float:
        """The host-tier reload before ``req``'s first step on ``s``: its host-hit tokens
        (``host_tokens``) at ``host_link_bytes_per_s``; 0 without host hits. The link's queue
        of other reloads is not known to the router and not counted. O(1)."""
        return self.host_tokens(req, s) * self.reload_s_per_token

    def expected_ttft(self, req: RouteRequest, s: ReplicaState, cached_tokens: int, prefill_s: float,
                      wait_s: float, fullness: float) -> float:
        """T_rj without the extra-work term: the wait, the steps that compute ``req``'s first
        token (with ``decode_batch``: its uncached tokens on top of ``cached_tokens``, one step
        per ``prefill_chunk`` tokens, batched with the decodes of ``s``'s running requests, their
        context estimated as the outstanding requests' blocks times the running fraction; else
        P_rj) and the footprint term. O(1), O(n / prefill_chunk) for a prompt of n > 1 chunk."""
        cfg = self.config
        if cfg.decode_batch:
            n = req.prompt_tokens - cached_tokens
            ctx = s.active_blocks * self.block_size * s.running // s.outstanding if s.outstanding else 0
            # one step per chunk, the decodes in each (one step where the prompt fits a chunk)
            step = self.cost.chunked_prefill_time(n, cached_tokens, self.prefill_chunk, s.running, ctx)
        else:
            step = prefill_s
        return wait_s + step + cfg.footprint_weight * prefill_s * fullness

    def rank(self, req: RouteRequest, states: Sequence[ReplicaState]) -> Ranking:
        ss = by_id(states)
        now = self.clock.now()
        cfg = self.config
        # the cached tokens and P_rj depend on the match only: priced once per distinct match
        # (most replicas share one: none, or the shared prefix)
        price: dict[int, tuple[int, float]] = {}
        cached: dict[int, int] = {}
        prefill: dict[int, float] = {}
        for s in ss:
            cp = price.get(s.matched_blocks)
            if cp is None:
                c = self.cached_tokens(req, s)
                cp = price[s.matched_blocks] = (c, self.prefill_time(req.prompt_tokens - c, c))
            cached[s.replica], prefill[s.replica] = cp
        least = min(prefill.values())
        if cfg.footprint == "index":
            biggest = max([s.index_blocks for s in ss]) or 1
            fullness = {s.replica: s.index_blocks / biggest for s in ss}
        else:
            kmax = max(cfg.kv_floor, *[s.kv_usage for s in ss]) or 1.0
            fullness = {s.replica: s.kv_usage / kmax for s in ss}
        wait: dict[int, float] = {}
        ttft: dict[int, float] = {}
        first: dict[int, float] = {}
        expected_wait, t_of = self.expected_wait, self._t
        own: dict[int, float] = {}  # T_rj without the wait it adds to the requests it passes
        passed = self.passed_delay if cfg.overtake_weight and cfg.wait_model == "queue" else None  # FCFS: none passed
        for s in ss:
            j = s.replica
            c, p = cached[j], prefill[j]
            w = wait[j] = expected_wait(s, p, c, None, now)
            own[j], first[j] = t_of(req, s, c, p, w, fullness[j], least, now)
            ttft[j] = own[j] + passed(s, p) if passed is not None and s.queued_prefills else own[j]
        if req.objective_s > 0.0 and min(own.values()) > req.objective_s and any(
                s.class_view is not None for s in ss):
            # no replica meets the class's objective by the whole queue: price the wait on the
            # queue the request's class sees (module docstring); it passes the lower tiers by
            # design, so the wait it adds to them is not charged
            wait = {s.replica: (self.expected_wait if s.class_view is None else self.class_wait)(
                s, prefill[s.replica], cached[s.replica]) for s in ss}
            for s in ss:
                j = s.replica
                ttft[j], first[j] = t_of(req, s, cached[j], prefill[j], wait[j], fullness[j], least, now)
        # equal T (idle replicas): more cache, then fewer outstanding, then the emptier cache
        # (SGLang's smallest tree for new prefixes, so sequential cold prompts spread over the
        # cluster's memory), then the id
        order = [k[-1] for k in sorted([(ttft[s.replica], -cached[s.replica], s.outstanding, s.index_blocks, s.replica)
                                        for s in ss])]
        best = max(cached.values())
        pick = order[0]
        if self.config.sticky_match > 0:
            pick = self._sticky_target(req, order, cached, ttft, pick)
        if self.config.rule == "affinity" and best > 0:
            j = self._affinity_target(req, ss, cached, wait, order)
            if wait[j] <= self.config.theta * max(prefill[j], self.config.p_floor_s):
                pick = j
        seed = self._seed_target(req, ss, cached, best, ttft, fullness) if self.config.replicate else None
        if seed is not None:
            pick = seed
            reason = "replicate"
        elif best == 0:
            reason = "cold"
        else:
            reason = "affinity" if cached[pick] == best else "fair"
        return Ranking(ranks_of([pick], (r for r in order if r != pick)), reason, ttft, wait, first)

    def _t(self, req: RouteRequest, s: ReplicaState, cached: int, prefill: float, wait: float, fullness: float,
           least: float, now: float) -> tuple[float, float]:
        """T_rj from its terms (the module docstring's rule), and the first token's expected time
        on ``s`` (``Ranking.expected_s``): T_rj without the terms that only price a placement
        (the footprint, the extra work, the delay to others). The wait added to the requests it
        passes is ``passed_delay``'s, added by the caller. O(1)."""
        cfg = self.config
        t = self.expected_ttft(req, s, cached, prefill, wait, fullness)
        first = t - cfg.footprint_weight * prefill * fullness  # the wait and the first step
        # each term skipped where it is exactly 0 (a speed of 1): the sum is the same to the bit
        if cfg.speed_aware:
            t = t / s.speed
            first = first / s.speed
        if cfg.extra_work_weight:
            t = t + cfg.extra_work_weight * (prefill - least)
        if cfg.delay_weight and s.routed_prefills:
            t = t + cfg.delay_weight * self.arrivals_delay(s, prefill, now)
        if self.host_tier and s.host_blocks:
            reload = self.reload_s(req, s)
            t = t + reload
            first = first + reload
        return t, first

    def class_wait(self, s: ReplicaState, prefill_s: float, cached_tokens: int) -> float:
        """W_rj as the request's class sees replica ``s`` (``ReplicaState.class_view``): the
        other classes' work its gate serves first, plus the wait model over its own class's
        queue. O(log n + n) as ``expected_wait``."""
        v = s.class_view
        assert v is not None
        return v.ahead_s + self.expected_wait(s, prefill_s, cached_tokens, (v.queued_s, v.queued))

    def on_adopted(self, hashes: Sequence[int], matched_blocks: int, prompt_tokens: int) -> None:
        """A decision of another router instance counts in the prefix shares as one of ours, so
        K routers that share a view replicate on the whole traffic's shares, not on 1/K of it.
        The prefix is named by the decision's best match, as ``_seed_target`` names it for our
        own decisions, wherever the request went (a seed, a cold pick or a fair one). O(1)."""
        now = self.clock.now()
        self.shares.observe(now)
        b = min(matched_blocks, max(0, (prompt_tokens - 1) // self.block_size))
        if b > 0:
            self.shares.share(int(hashes[b - 1]), now)

    def _seed_target(self, req: RouteRequest, ss: Sequence[ReplicaState], cached: dict[int, int], best: int,
                     ttft: dict[int, float], fullness: dict[int, float]) -> int | None:
        """The non-holder that should get one more copy of the prefix ``req`` shares with its
        best-cached replicas (named by its last matched block), or None: the rule is the module
        docstring's "Hot-prefix replication", comparing the non-holders' T with the prefix
        cached against the holders' best T (without the footprint terms unless
        ``seed_footprint``), so an idle cluster makes no copy. O(R)."""
        now = self.clock.now()
        self.shares.observe(now)
        if best <= 0:
            return None
        share = self.shares.share(int(req.block_hashes[best // self.block_size - 1]), now)
        holders = sum(1 for c in cached.values() if c == best)
        if share is None or holders == len(cached) or share <= holders / len(cached):
            return None
        p_warm = self.prefill_time(req.prompt_tokens - best, best)
        # a holder's own prefill is p_warm too, so its footprint term is weight x p_warm x fullness
        full = fullness if self.config.seed_footprint else dict.fromkeys(fullness, 0.0)
        foot = self.config.footprint_weight * p_warm
        warm = {s.replica: self.expected_ttft(req, s, best, p_warm, self.expected_wait(s, p_warm, best),
                                              full[s.replica])
                for s in ss if cached[s.replica] < best}
        j = min(warm, key=lambda r: (warm[r], r))
        scale = {s.replica: s.speed if self.config.speed_aware else 1.0 for s in ss}  # as ``_t`` divides T
        held = min(t - foot * (fullness[r] - full[r]) / scale[r] for r, t in ttft.items() if cached[r] == best)
        return j if warm[j] < held else None

    def _sticky_target(self, req: RouteRequest, order: list[int], cached: dict[int, int], ttft: dict[int, float],
                       pick: int) -> int:
        """The pick under ``sticky_match`` = m > 0: when some replica caches at least m of the
        prompt and the minimum-T pick does not, the best T among those replicas, unless its T
        exceeds the pick's by more than ``sticky_slack`` times the request's prefill with nothing
        cached (then ``pick``). O(R)."""
        need = self.config.sticky_match * req.prompt_tokens
        if cached[pick] >= need:
            return pick
        # ``order`` is by T, so the first holder has the best T among them
        j = next((j for j in order if cached[j] >= need), None)
        if j is None:
            return pick
        slack = self.config.sticky_slack * self.prefill_time(req.prompt_tokens, 0)
        return j if ttft[j] - ttft[pick] <= slack else pick

    def _affinity_target(self, req: RouteRequest, ss: Sequence[ReplicaState], cached: dict[int, int],
                         wait: dict[int, float], order: list[int]) -> int:
        """j* for rule="affinity": the best-cached replica, ties to the smaller W, then per
        ``affinity_ties`` (``order`` is the ranking by T). O(R)."""
        if self.config.affinity_ties == "hash":
            return self._hash_tie(req, cached, wait)
        if self.config.affinity_ties == "id":
            return min(cached, key=lambda r: (-cached[r], wait[r], r))
        pos = {r: i for i, r in enumerate(order)}
        if self.config.affinity_ties == "kv":
            kv = {s.replica: s.kv_usage for s in ss}
            return min(cached, key=lambda r: (-cached[r], wait[r], kv[r], pos[r]))
        return min(cached, key=lambda r: (-cached[r], wait[r], pos[r]))

    def _hash_tie(self, req: RouteRequest, cached: dict[int, int], q: dict[int, float]) -> int:
        """j* with affinity_ties="hash": among the replicas with the best match and, among those,
        the smallest Q_j, the rendezvous-hash winner for the prompt's first block after the
        match (its chained hash names the prompt up to that block; the last block when the match
        is capped at the cacheable prefix). Requests that share that deeper prefix land
        together, as consistent hashing places them; requests that share only the matched part
        (a preamble every replica holds) spread evenly. O(R)."""
        best = max(cached.values())
        tied = [r for r in cached if cached[r] == best]
        qmin = min(q[r] for r in tied)
        tied = [r for r in tied if q[r] == qmin]
        if len(tied) == 1 or not req.block_hashes:
            return min(tied)
        key = int(req.block_hashes[min(best // self.block_size, len(req.block_hashes) - 1)])
        data = (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
        return max(tied, key=lambda r: (xxhash.xxh3_64_intdigest(data, seed=r), -r))



def router_options_for(router: str, options: dict, replica_policy: str,
                       replica_options: dict | None = None, prefill_chunk: int | None = None) -> dict[str, object]:
    """A router policy's options as hosts pass them: ``options``, plus, for ``fairway`` and
    where ``options`` leave them out, the wait model matching the replicas' queue policy and
    the replicas' engine ``prefill_chunk`` (``fairway.engine.model.prefill_chunk``; None: the
    router's default)."""
    out = dict(options)
    if router == "fairway":
        for k, v in queue_model_options(replica_policy, replica_options).items():
            out.setdefault(k, v)
        if prefill_chunk is not None:
            out.setdefault("prefill_chunk", int(prefill_chunk))
    return out


def queue_model_options(policy: str, policy_options: dict | None = None) -> dict[str, object]:
    """The Fairway router's wait-model options for replicas running queue policy ``policy``
    (hosts pass these unless the operator set them): the queue model with the replicas' Fast-lane
    share (and their promotion threshold theta where they set one) for ``fairway`` replicas,
    W = Q_j for any other policy. O(1)."""
    if policy != "fairway":
        return {"wait_model": "fcfs"}
    opts = policy_options or {}
    out: dict[str, object] = {"wait_model": "queue",
                              "fast_share": 1.0 - float(opts.get("fair_share", FairwayConfig().fair_share))}
    if "theta" in opts:
        out["theta"] = float(opts["theta"])
    return out


__all__ = ["DEFAULT_FAST_SHARE", "DEFAULT_THETA", "FairwayRouter", "FairwayRouterConfig", "queue_model_options",
           "router_options_for"]
