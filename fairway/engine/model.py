"""Engine model: one vLLM-v1-like replica (prefix cache, continuous batching, chunked prefill).

Per step (``start_step``), as vLLM v1's scheduler does:
1. Running requests first, in admission order: a prefilling request gets its next chunk (up to
   the remaining token budget, and to ``long_prefill_token_threshold`` when set), a decoding
   request 1 token. A request that needs a new KV block when none is free preempts the policy's
   victim (default: the newest running request), which releases its blocks and goes back to the
   waiting queue for recompute. A step that preempted admits nothing new.
2. Then waiting requests, in the policy's order, while budget and ``max_num_seqs`` allow.
   **Memory decides admission**: the head request is admitted only if blocks for its whole
   prompt (beyond its cache hit) fit in the free pool; otherwise admission stops for this step
   (head-of-line, as vLLM's scheduler ``break``s).
3. Step time comes from the cost model on the batch aggregates; ``finish_step`` applies the
   step's effects at its end time: computed tokens advance, newly full blocks enter the prefix
   cache, first tokens and finishes are stamped.

Deviation from vLLM v1, stated: vLLM allocates blocks chunk by chunk; we reserve the whole prompt
at admission (vLLM v0's ``can_allocate``), which avoids preemption storms from half-admitted
prompts and makes the admission limit explicit.

The waiting queue *is* the policy object, so the same policy code orders admission here, in the
replica gate and in the router.

Beyond stock vLLM, off by default (docs/cost-model.md, KV memory beyond the GPU): a host KV tier
(``host_kv_blocks``: evicted blocks reload at ``host_link_bytes_per_s``, asynchronously: the
request is not scheduled until its load lands), a retention strategy (the block pool's victim
order; the policy's ``retention`` unless the config names one), and the session-aware admission
gate of ``fairway.admission`` (``admission``), which filters the policy's picks: held requests
sit outside the policy's queue, in ``held``, until their rule or bound releases them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import Any

from fairway.admission import AdmissionConfig, Candidate, HeldQueue, SessionAdmission, WaitingSessions
from fairway.clock import Clock
from fairway.cost_model import CostModel, link_bandwidth, reload_s_per_token
from fairway.engine.block_pool import QUEUE, RETENTIONS, SESSION, BlockPool
from fairway.first_step import first_step_hold_pays
from fairway.memory_view import KVMemoryView
from fairway.policies.base import QueuedRequest, QueuePolicy
from fairway.request import RequestSpec

#: vLLM's own defaults for its OpenAI server on a GPU with at least 70 GiB that is not an A100
#: (H100, H200: the GPU the cost profiles are measured on): ``EngineArgs._set_default_args`` in
#: vllm-project/vllm, vllm/engine/arg_utils.py. Smaller GPUs get 2048 tokens and 256 sequences
#: there. Every host (the simulator, its CLIs, the simulated replica) defaults to these.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits (vLLM names, and its defaults on an H200: ``DEFAULT_*`` above).

    block_size: tokens per KV block (16).
    max_num_batched_tokens: per-step token budget for chunked prefill + decode (8192).
    max_num_seqs: most requests running at once (1024; memory usually binds first).
    kv_blocks: KV capacity in blocks; None derives it from GPU memory via the cost profile.
    retention: the block pool's eviction strategy (``lru``, ``peek``, ``prism``, ``session``);
        None takes the queue policy's ``retention``.
    host_kv_blocks: capacity of the host (CPU) KV tier in blocks; 0 = no host tier.
    host_link_bytes_per_s: host-to-GPU copy bandwidth for reloads (PCIe 5.0 x16, ~50 GB/s per
        direction on an H200 host).
    admission: the session-aware admission gate's config (``fairway.admission``); None = off.
    strict_prefill_first: with request classes, a step in which the strictest tier has prefill
        to run (a running request of it not past its prompt, or one waiting) runs no prefill of a
        lower tier, and admits none: the strict tier's chunks run in steps of their own size
        instead of sharing a full token budget with batch prefill (docs/history/
        2026-12-03-strict-prefill.md). Decodes go on. Off: vLLM's order (running first).
    long_prefill_token_threshold: the most prompt tokens one request computes in a step, running
        or newly admitted, while the engine holds more than one request (vLLM's
        ``--long-prefill-token-threshold``, vllm/v1/core/sched/scheduler.py); 0 = no cap beyond
        the step's budget, vLLM's default. A long prompt then spans several shorter steps, so a
        short one arriving while it prefills waits for one of its chunks, not for its whole
        prompt. vLLM's adaptive floor on the cap is not modelled.
    """

    block_size: int = 16
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_blocks: int | None = None
    retention: str | None = None
    host_kv_blocks: int = 0
    host_link_bytes_per_s: float = 50e9
    admission: AdmissionConfig | None = None
    strict_prefill_first: bool = False
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("engine limits must be positive")
        if self.kv_blocks is not None and self.kv_blocks <= 0:
            raise ValueError("kv_blocks must be positive")
        if self.retention is not None and self.retention not in RETENTIONS:
            raise ValueError(f"unknown retention {self.retention!r}; known: {', '.join(RETENTIONS)}")
        if isinstance(self.host_kv_blocks, bool) or not isinstance(self.host_kv_blocks, int) or self.host_kv_blocks < 0:
            raise ValueError("host_kv_blocks must be an integer >= 0 (0: no host KV tier)")
        link_bandwidth(self.host_link_bytes_per_s)
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0 (0: no cap)")

    @property
    def chunk_cap(self) -> int:
        """The most tokens one request computes in a step: the threshold, else the budget."""
        return prefill_chunk(self.max_num_batched_tokens, self.long_prefill_token_threshold)


def prefill_chunk(max_num_batched_tokens: int, long_prefill_token_threshold: int = 0) -> int:
    """The most prompt tokens one request computes in a step of an engine with this token budget
    and per-request cap (0: none): the cap where it is lower, else the budget. The router prices
    a long prompt in steps of this many tokens (``CostModel.chunked_prefill_time``). O(1)."""
    t = long_prefill_token_threshold
    return t if 0 < t < max_num_batched_tokens else max_num_batched_tokens


@dataclass(slots=True)
class EngineRequest:
    """A request inside the engine, and its record.

    Invariants: ``num_computed <= prompt + generated``; ``generated <= output``;
    ``len(blocks) * block_size >= num_computed``; times are non-decreasing
    arrival <= admitted <= first_token <= finished once set.
    """

    spec: RequestSpec
    seq: int
    replica: int = 0
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    generated: int = 0
    n_hashed: int = 0
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finished_s: float = -1.0
    preemptions: int = 0
    cached_tokens: int = -1  # prefix-cache hit at first admission
    lane: str = ""
    promoted: bool = False
    uncached_at_arrival: int = 0
    est_prefill_at_arrival_s: float = 0.0
    rejected: str = ""
    aborted: bool = False  # the host gave up on it (its client left) before it finished
    host_tokens: int = 0  # reloaded from the host tier at first admission
    demand: tuple[int, ...] = ()  # hashes declared as queue demand while it waits
    wait_token: int = 0  # admission gate: this wait's entry in the engine's deadline heap
    queued: QueuedRequest | None = None  # the policy's record of this wait
    exempt: bool = False  # admission gate: held to its bound once already in this wait
    step_held: bool = False  # first-step hold: kept out of a step its prefill would have ended in
    ready_s: float = 0.0  # running, but not schedulable before this (host-tier reload in flight)

    @property
    def rid(self) -> int:
        return self.spec.rid

    @property
    def target(self) -> int:
        """Tokens known so far: the prompt plus generated output."""
        return self.spec.prompt_tokens + self.generated

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.spec.arrival_s


def _prefill_left(r: EngineRequest) -> bool:
    """Whether running ``r`` has prompt (or, preempted, context) tokens still to compute beyond
    its next decode token. O(1)."""
    return r.target - r.num_computed > (1 if r.generated else 0)


def _step_shape(batch: list[tuple[EngineRequest, int]]) -> tuple[int, int, int, int, int, int]:
    """A step's aggregates for ``CostModel.step_time``: (prefill tokens, sum n*c, sum n^2 over the
    prefill chunks, decoding requests, their context tokens), and how many of the chunks end their
    request's prompt (a first token at the step's end). O(batch), once per step."""
    p_tok = p_ctx = p_sq = d_seqs = d_ctx = first = 0
    for r, n in batch:
        c = r.num_computed
        if n == 1 and r.generated > 0 and c + 1 == r.spec.prompt_tokens + r.generated:
            d_seqs += 1
            d_ctx += c
            continue
        p_tok += n
        p_ctx += n * c
        p_sq += n * n
        if r.generated == 0 and c + n >= r.spec.prompt_tokens:
            first += 1
    return p_tok, p_ctx, p_sq, d_seqs, d_ctx, first


class EngineListener:
    """An observer of an ``EngineModel``'s lifecycle (``EngineModel.listener``): the simulator's
    cluster router host and the ``sim`` engine subclass it and override what they need; every
    callback defaults to nothing. Each is called in the step that causes it, O(1) per call here."""

    def on_admitted(self, replica: int, r: EngineRequest) -> None:
        """``r`` entered the running batch."""

    def on_first_token(self, replica: int, r: EngineRequest) -> None:
        """``r``'s first output token was produced."""

    def on_preempted(self, replica: int, r: EngineRequest) -> None:
        """``r`` was preempted back to the waiting queue."""

    def on_finished(self, replica: int, r: EngineRequest) -> None:
        """``r`` finished (or was rejected at arrival)."""

    def on_kv_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        """``(stored, hash)`` prefix-cache events of one flush, in order."""

    def on_kv_tier_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        """Host tier only: ``(host_only, hash)`` transitions, after the same flush's KV events."""

    @property
    def hears_kv_events(self) -> bool:
        """Whether ``on_kv_events`` does anything: when not, an engine's KV events may reach it
        late (``EngineModel.plain_steps``). True unless a listener says otherwise."""
        return True


class EngineModel:
    """One replica's engine. Host protocol: ``add`` arrivals; when idle and ``has_work()``,
    ``start_step()`` returns the step duration; at its end, ``finish_step()`` returns the requests
    that finished."""

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        policy: QueuePolicy,
        clock: Clock,
        replica: int = 0,
    ) -> None:
        self.config = config
        self.cost = cost
        self.policy = policy
        self.clock = clock
        self.replica = replica
        bs = config.block_size
        n_blocks = config.kv_blocks or cost.default_kv_blocks(bs)
        self.retention = config.retention or getattr(policy, "retention", "lru")
        self.gate = SessionAdmission(config.admission) if config.admission is not None else None
        self.pool = BlockPool(n_blocks, bs, retention=self.retention, host_blocks=config.host_kv_blocks,
                              track_demand=self.gate is not None)
        self._track = self.pool.tracking
        self.held: HeldQueue[Any] = HeldQueue()
        self._due: list[tuple[float, int, int]] = []  # (deadline, wait token, rid) of waiting requests
        self._wait_seq = 0
        horizon = (config.admission or AdmissionConfig()).session_horizon_s if self._track else 0.0
        self.sessions = WaitingSessions(horizon)
        # seconds to reload one token's KV from the host tier
        self._reload_s_per_token = reload_s_per_token(cost, config.host_link_bytes_per_s)
        self._link_free_s = 0.0  # when the host-to-GPU link finishes its queued reloads
        self.gpu_hit_tokens = 0  # first admissions: prompt tokens served by GPU hits,
        self.host_hit_tokens = 0  # by host-tier reloads,
        self.miss_tokens = 0  # and computed
        self.holds = 0  # requests the admission gate held back
        self.first_step_holds = 0  # steps a pick was held out of (``fairway.first_step``)
        self._cap = config.max_num_batched_tokens  # this step's chunk cap per request (start_step)
        self.hold_releases_due = 0  # of which released by the starvation bound
        self.reload_s = 0.0
        self.prefill_tokens = 0  # prompt tokens computed (recomputes after eviction included)
        # the policy's cache view: either tier with a host tier, else the GPU dict itself (no
        # second lookup per probe on the default path)
        policy.attach_cache(self.pool.__contains__ if config.host_kv_blocks else self.pool.cached.__contains__)
        self.reqs: dict[int, EngineRequest] = {}  # waiting + running
        self.running: list[EngineRequest] = []
        # the memory view a live gate has (fairway/memory_view.py), fed the same way: the pool's
        # free count, the running requests' prompts, the policy's tracked hits (counted only
        # while the policy needs them)
        self.memory: KVMemoryView | None = None
        if policy.wants_memory_view():
            pool = self.pool
            self.memory = KVMemoryView(lambda: len(pool.free), clock, policy.memory_horizon_s(),
                                       cached=pool.cached.__contains__, running=self._held_prompts, on_demand=True)
            policy.attach_memory(self.memory)
        self._batch: list[tuple[EngineRequest, int]] = []
        self._seq = 0
        # optional lifecycle observer (the cluster router host, the sim engine)
        self.listener: EngineListener | None = None
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # time in steps that computed prompt tokens
        self.steps = 0
        self.preemptions = 0
        # sequence slots: the most requests running at once, and the steps in which every slot
        # was taken while requests waited (``max_num_seqs`` bound admission, not memory)
        self.peak_running = 0
        self.slot_bound_steps = 0

    # -- arrivals ----------------------------------------------------------------------------

    def add(self, spec: RequestSpec) -> EngineRequest:
        """Queue an arriving request. A request that cannot fit in the whole KV cache is
        rejected (returned with ``rejected`` set) instead of blocking the queue forever."""
        bs = self.config.block_size
        r = EngineRequest(spec=spec, seq=self._seq, replica=self.replica)
        self._seq += 1
        need = -(-(spec.prompt_tokens + spec.output_tokens) // bs)
        if need > self.pool.num_blocks:
            r.rejected = f"needs {need} KV blocks, engine has {self.pool.num_blocks}"
            if self.listener is not None:
                self.listener.on_finished(self.replica, r)
            return r
        self.reqs[spec.rid] = r
        if self._track and spec.session >= 0:
            ctx = self.sessions.arrive(spec.session)
            if ctx is not None:
                self.pool.add_demand(ctx, SESSION, -1)
        self._enqueue(r)  # (neither the above nor the queueing changes the cache)
        c = self._tracked_hit(r)
        if c is None:
            hit, host_n, _ = self._plan(r)
            c = len(hit) + host_n
        c *= bs
        r.uncached_at_arrival = spec.prompt_tokens - c
        r.est_prefill_at_arrival_s = self.cost.prefill_time(spec.prompt_tokens - c, c)
        return r

    def _enqueue(self, r: EngineRequest) -> None:
        n_known = r.target
        bs = self.config.block_size
        r.exempt = False
        if self._track:
            r.demand = self._cacheable(r)
            self.pool.add_demand(r.demand, QUEUE, 1)
        if self.gate is not None and self.gate.config.guard == "all":
            hit, host_n, new_blocks = self._plan(r)
            deadline = self.gate.deadline(self._candidate(r, hit, host_n, new_blocks))
            if r.generated:
                # preempted after its first token: the bound runs from now (the guard bounds the
                # wait for a first token; a resumed decode must not jump the queue at once)
                deadline += self.clock.now() - r.spec.arrival_s
            self._set_deadline(r, deadline)
        r.queued = QueuedRequest(
            rid=r.rid,
            arrival_s=r.spec.arrival_s,
            prompt_tokens=n_known,
            block_hashes=r.spec.block_hashes[: n_known // bs],
            seq=r.seq,
            output_tokens=r.spec.output_tokens,
            priority_class=r.spec.priority_class,
            tenant=r.spec.tenant or "",
        )
        self.policy.add(r.queued)

    def _cacheable(self, r: EngineRequest) -> tuple[int, ...]:
        n = max(0, (r.target - 1) // self.config.block_size)
        return r.spec.block_hashes[:n]

    # -- steps -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0 or len(self.held) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.policy) + len(self.held)

    @property
    def scheduled(self) -> list[EngineRequest]:
        """The requests in the step ``start_step`` scheduled and ``finish_step`` will apply
        (real-time hosts read it to know whose tokens a step produced)."""
        return [r for r, _ in self._batch]

    def start_step(self) -> float | None:
        """Schedule one step at the current time; return its duration, or None if nothing
        could be scheduled."""
        now = self.clock.now()
        cfg = self.config
        bs = cfg.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        # vLLM's long-prefill cap, lifted while one request is all there is (nobody to starve)
        cap = cfg.chunk_cap
        if cap < budget and len(self.running) + len(self.policy) <= 1:
            cap = budget
        self._cap = cap
        batch: list[tuple[EngineRequest, int]] = []
        if self._track and len(self.sessions):
            for ctx in self.sessions.expire(now):
                pool.add_demand(ctx, SESSION, -1)
        if self.gate is not None and self.gate.config.preempt_for_due:
            self._make_room_for_due(now)
        preempted = 0
        i = 0
        running = self.running  # (a preemption rebinds self.running: reread below)
        free = pool.free  # len(free) is pool.num_free, without a property call per request
        strict = cfg.strict_prefill_first and self._strict_prefill()
        lower = self.policy.lower_tier if strict else None  # read only while a strict tier prefills
        while i < len(running) and budget > 0:
            r = running[i]
            if r.ready_s > now or (strict and _prefill_left(r) and lower(r.spec.priority_class)):
                i += 1  # its KV is still loading from the host tier, or a strict tier's prefill runs
                continue
            done = r.num_computed
            n = r.spec.prompt_tokens + r.generated - done  # r.target - num_computed, inlined
            if n > cap:
                n = cap
            if n > budget:
                n = budget
            need = -(-(done + n) // bs) - len(r.blocks)
            if need <= 0:  # the usual decode step: no new block
                batch.append((r, n))
                budget -= n
                i += 1
                continue
            victim_is_r = False
            while need > len(free):
                v = self.policy.preempt_victim([x.rid for x in self.running])
                victim = self.running[v]
                self._preempt(victim)
                preempted += 1
                if victim is r:
                    victim_is_r = True
                    break
                if v < i:
                    i -= 1
            running = self.running
            if victim_is_r:
                continue
            r.blocks.extend(pool.allocate(need))
            self._flush_events()
            batch.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(now, batch, budget, strict)
        if not batch:
            self._batch = []
            loading = [r.ready_s for r in self.running if r.ready_s > now]
            return min(loading) - now if loading else None  # idle until a reload lands
        p_tok, p_ctx, p_sq, d_seqs, d_ctx, _ = _step_shape(batch)
        dt = self.cost.step_time(p_tok, p_ctx, p_sq, d_seqs, d_ctx)
        self._batch = batch
        self.policy.on_step(p_tok)
        self.steps += 1
        n_running = len(self.running)
        if n_running > self.peak_running:
            self.peak_running = n_running
        if n_running >= cfg.max_num_seqs and (len(self.policy) or len(self.held)):
            self.slot_bound_steps += 1
        self.prefill_tokens += p_tok
        self.busy_s += dt
        if p_tok:
            self.prefill_busy_s += dt
        return dt

    def finish_step(self) -> list[EngineRequest]:
        """Apply the scheduled step at its end time (the clock's now)."""
        now = self.clock.now()
        bs = self.config.block_size
        pool = self.pool
        done: list[EngineRequest] = []
        for r, n in self._batch:
            r.num_computed = computed = r.num_computed + n
            spec = r.spec
            full = computed // bs
            if full > r.n_hashed:
                hashes = spec.block_hashes
                if full > len(hashes):
                    full = len(hashes)
                if full > r.n_hashed:
                    pool.cache_blocks(r.blocks[r.n_hashed : full], hashes[r.n_hashed : full])
                    r.n_hashed = full
            if computed == spec.prompt_tokens + r.generated:  # r.target, inlined
                r.generated += 1
                if r.first_token_s < 0:
                    r.first_token_s = now
                    if self.listener is not None:
                        self.listener.on_first_token(self.replica, r)
                if r.generated >= r.spec.output_tokens:
                    r.finished_s = now
                    done.append(r)
        self._batch = []
        if done:
            finished = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in finished]
            for r in done:
                pool.release(r.blocks)
                r.blocks = []
                if self.memory is not None:
                    self._unhold(r, finished=True)
                del self.reqs[r.rid]
                if self._track and r.spec.session >= 0 and self.sessions.horizon_s > 0:
                    ctx = r.spec.block_hashes[: r.n_hashed]
                    old = self.sessions.finish(r.spec.session, now, ctx)
                    if old is not None:
                        pool.add_demand(old, SESSION, -1)
                    pool.add_demand(ctx, SESSION, 1)
                if self.listener is not None:
                    self.listener.on_finished(self.replica, r)
        self._flush_events()
        return done

    # -- plain decode steps, taken in bulk by a host that knows nobody reads the engine between ----

    def plain_steps(self) -> int:
        """Right after ``start_step``: how many of the coming step boundaries (the end of the
        step in flight, then the start of the next, at one instant) are plain, given that no
        request arrives meanwhile. A boundary is plain when ``finish_step`` then ``start_step``
        would only add one token to every running request, cache the blocks that fill, give
        a new block to those that need one, and schedule the same batch again: each running
        request decodes one token in the step in flight (the batch is the whole running list,
        in order), nothing waits or is held, none reaches its output length, the free blocks
        cover the new ones, and the engine has no admission gate, no host tier and no
        demand-aware retention. Such boundaries reach nothing outside the engine but KV events
        (blocks cached, blocks evicted for new ones), so with a listener that hears KV events
        (``EngineListener.hears_kv_events``) none may cache or take a block. A host may apply
        plain boundaries later in one ``skip_plain`` call, up to the first that is not.

        Why: at a light load most steps decode one or two requests and do nothing else; the
        simulator takes those in bulk instead of one event each (sim/simulator.py).
        Complexity: O(running x log(max_num_batched_tokens))."""
        batch, running = self._batch, self.running
        if (not batch or len(batch) != len(running) or len(self.policy) or len(self.held)
                or self.gate is not None or self._track or self.pool.host_capacity):
            return 0
        bs = self.config.block_size
        hears = self.listener is not None and getattr(self.listener, "hears_kv_events", True)  # no flag: hears
        k = self.config.max_num_batched_tokens  # a cap on one bulk (the next is planned at its end)
        first: list[int] = []  # per request, the boundary at which it takes a new block
        for (r, n), x in zip(batch, running, strict=True):
            spec = r.spec
            c = r.num_computed
            if r is not x or n != 1 or not r.generated or c + 1 != spec.prompt_tokens + r.generated:
                return 0
            # after boundary i the request holds c + i tokens and has generated generated + i
            k = min(k, spec.output_tokens - r.generated - 1)
            if hears and len(spec.block_hashes) > r.n_hashed:  # a hashed block fills at c + i
                k = min(k, bs * (r.n_hashed + 1) - c - 1)
            first.append(bs * len(r.blocks) - c)  # c + i + 1 tokens need a block more there
        if hears:
            return max(0, min(k, min(first) - 1))
        free = self.pool.num_free
        lo, hi = 0, max(0, k)  # the most boundaries whose new blocks the free ones cover
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(1 + (mid - f) // bs for f in first if f <= mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plain_step_times(self, k: int) -> list[float]:
        """Durations of the steps that plain boundaries 1..``k`` of the batch in flight start:
        ``step_time`` of their decode tokens on the same integers ``start_step`` would use
        (every request one token further at each). O(batch + k)."""
        d = len(self._batch)
        ctx = sum(r.num_computed for r, _ in self._batch)
        step_time = self.cost.step_time
        return [step_time(0, 0, 0, d, ctx + i * d) for i in range(1, k + 1)]

    def skip_plain(self, dts: Sequence[float], finish: bool = False) -> None:
        """Apply ``len(dts)`` plain boundaries (``plain_steps``), the steps they start lasting
        ``dts``: exactly the effects ``finish_step`` then ``start_step`` would have there, in
        their order (at each boundary the blocks that filled are cached, in batch order, and
        flushed once; then each new block is taken and flushed, in batch order). ``finish``:
        then the end of the step in flight too, without starting the next (an arrival at that
        very instant is to be admitted with it): the engine is left between steps.
        O(batch + len(dts) + blocks cached or taken)."""
        m = len(dts)
        batch = self._batch
        bs = self.config.block_size
        last = m + 1 if finish else m  # the boundaries whose step end applies
        marks: list[tuple[int, int, int]] = []  # (boundary, 0 cache / 1 new block, batch index)
        for idx, (r, _) in enumerate(batch):
            c, top = r.num_computed, len(r.spec.block_hashes)
            if top > r.n_hashed:  # block n_hashed fills at boundary bs * (n_hashed + 1) - c, ...
                marks.extend((i, 0, idx) for i in range(bs * (r.n_hashed + 1) - c, min(last, bs * top - c) + 1, bs))
            marks.extend((i, 1, idx) for i in range(bs * len(r.blocks) - c, m + 1, bs))
        if marks:
            marks.sort()
            pool = self.pool
            for (i, kind), group in groupby(marks, key=itemgetter(0, 1)):
                if kind == 0:  # a step end: the filled blocks, then one flush
                    for _, _, idx in group:
                        r = batch[idx][0]
                        full = (r.num_computed + i) // bs
                        pool.cache_blocks(r.blocks[r.n_hashed : full], r.spec.block_hashes[r.n_hashed : full])
                        r.n_hashed = full
                    self._flush_events()
                    continue
                for _, _, idx in group:  # a step start: each new block, flushed
                    batch[idx][0].blocks.extend(pool.allocate(1))
                    self._flush_events()
        for r, _ in batch:
            r.num_computed += last
            r.generated += last
        self.steps += m
        busy = self.busy_s
        on_step = self.policy.on_step
        for dt in dts:
            busy += dt
            on_step(0)
        self.busy_s = busy
        if finish:
            self._batch = []

    def abort(self, rid: int) -> bool:
        """Stop request ``rid`` wherever it is (waiting, running, or in the step now in flight;
        the step's cost is already spent, its work on this request is dropped): its queue entry
        and KV blocks are freed at once, the blocks it completed stay cached (as vLLM keeps the
        computed prefix of an aborted request). False if it is not here (finished, or unknown).
        O(running + waiting) for the queue and batch removals."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return False
        r.aborted = True
        running = [x for x in self.running if x is not r]
        was_running = len(running) < len(self.running)
        if was_running:
            self.running = running
        elif rid in self.held:
            self.held.remove(rid)
        else:
            self.policy.remove(rid)
        if r.demand:
            self.pool.add_demand(r.demand, QUEUE, -1)
            r.demand = ()
        self._batch = [(x, n) for x, n in self._batch if x is not r]
        self.pool.release(r.blocks)
        r.blocks = []
        if was_running and self.memory is not None:
            self._unhold(r, finished=True)
        self._flush_events()
        if self.listener is not None:
            self.listener.on_finished(self.replica, r)
        return True

    # -- admission ---------------------------------------------------------------------------

    def _tracked_hit(self, r: EngineRequest) -> int | None:
        """Waiting ``r``'s GPU hit in blocks as the policy's hit tracker keeps it, or None where
        it does not say (a host tier: the tracker's view covers both tiers; a policy without a
        tracker of its own). Why: the tracker follows this pool's events (tests/fairway/engine/
        test_model.py checks it against a fresh walk at every step), so a prompt of thousands
        of blocks need not be walked again at arrival and at each admission attempt. O(1)."""
        return None if self.pool.host_capacity else self.policy.hit_blocks(r.rid)

    def _plan(self, r: EngineRequest) -> tuple[list[int], int, int]:
        """(GPU hit blocks, host-tier blocks continuing the hit, new blocks to allocate).
        O(hit blocks): the blocks of the tracked hit, else a walk of the prompt."""
        pool = self.pool
        cacheable = self._cacheable(r)
        n = self._tracked_hit(r) if r.queued is not None and r.rid in self.policy else None
        hit = pool.longest_hit(cacheable) if n is None else pool.blocks_of(cacheable[:n])
        host_n = pool.host_hit(cacheable, len(hit)) if pool.host_capacity else 0
        return hit, host_n, self._new_blocks(r, len(hit))

    def _new_blocks(self, r: EngineRequest, hit_blocks: int) -> int:
        """Blocks ``r`` must allocate to hold its known tokens beyond a hit of ``hit_blocks``. O(1)."""
        return -(-r.target // self.config.block_size) - hit_blocks

    def _candidate(self, r: EngineRequest, hit: list[int], host_n: int, new_blocks: int) -> Candidate:
        c = (len(hit) + host_n) * self.config.block_size
        return Candidate(
            rid=r.rid,
            arrival_s=r.spec.arrival_s,
            prompt_tokens=r.target,
            cached_tokens=c,
            new_blocks=new_blocks,
            est_prefill_s=self.cost.prefill_time(r.target - c, c),
            first_turn=r.spec.session >= 0 and r.spec.turn == 0 and r.generated == 0,
        )

    def _admit_waiting(self, now: float, batch: list[tuple[EngineRequest, int]], budget: int,
                       strict: bool = False) -> int:
        """Admit waiting requests into ``batch`` while budget, ``max_num_seqs`` and memory
        allow; return the budget left. ``strict``: the strictest tier has prefill in this step,
        so a lower tier's pick waits (``EngineConfig.strict_prefill_first``). With the admission
        gate: held requests first (earliest deadline first; one past its deadline is admitted as
        soon as memory fits, and nothing else is admitted before it), then the policy's picks, of
        which the gate moves cold ones to the held queue instead of letting them evict waiting
        sessions' contexts."""
        cfg = self.config
        pool = self.pool
        gate = self.gate
        if gate is not None:
            # overdue first: a request past its bound is admitted before anyone else, oldest
            # deadline first, as soon as memory fits (nothing else is admitted meanwhile)
            while (r := self._overdue_head(now)) is not None:
                if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                    return budget
                hit, host_n, new_blocks = self._plan(r)
                if pool.free_after_touch(hit) < new_blocks:
                    return budget
                heapq.heappop(self._due)
                self.hold_releases_due += 1
                q = r.queued
                assert q is not None
                if r.rid in self.held:
                    self.held.remove(r.rid)
                    self.policy.add(q)
                budget = self._admit(r, q, hit, host_n, new_blocks, now, batch, budget)
        if gate is not None and len(self.held):
            for rid, held_until, q in self.held.in_order():
                if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                    return budget
                r = self.reqs[rid]
                if gate.config.guard == "policy" and now >= held_until:
                    # bound reached: back to the queue policy's order, not to be held again
                    self.held.remove(rid)
                    self.policy.add(q)
                    r.exempt = True
                    self.hold_releases_due += 1
                    continue
                hit, host_n, new_blocks = self._plan(r)
                idle = not self.running  # an idle engine holds no one
                if not idle and gate.should_hold(self._candidate(r, hit, host_n, new_blocks), now,
                                                 pool.num_free, pool.n_free_wanted, len(self.running)):
                    continue
                if pool.free_after_touch(hit) < new_blocks:
                    if idle:
                        return budget  # released by an idle engine: it waits for room, ahead of everyone
                    continue
                self.held.remove(rid)
                self.policy.add(q)
                budget = self._admit(r, q, hit, host_n, new_blocks, now, batch, budget)
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            q = self.policy.select()
            if q is None:
                break
            if strict and self.policy.lower_tier(q.priority_class):
                break
            r = self.reqs[q.rid]
            if gate is None:
                # head-of-line under memory pressure, the usual case of a memory-bound run: the
                # tracked hit says the new blocks alone exceed the free ones, so nothing can fit
                h = self._tracked_hit(r)
                if h is not None and pool.num_free < self._new_blocks(r, h):
                    break
            hit, host_n, new_blocks = self._plan(r)
            if gate is not None and not r.exempt:
                cand = self._candidate(r, hit, host_n, new_blocks)
                if gate.should_hold(cand, now, pool.num_free, pool.n_free_wanted, len(self.running)):
                    self.policy.remove(q.rid)
                    deadline = gate.deadline(cand)
                    self.held.add(q.rid, deadline, q)
                    if gate.config.guard == "held":
                        self._set_deadline(r, deadline)
                    self.holds += 1
                    continue
            if pool.free_after_touch(hit) < new_blocks:
                break  # memory-bound admission: the head waits for room
            if batch and self._hold_first_step(r, len(hit) + host_n, batch, budget):
                self.first_step_holds += 1
                break  # one step later; nothing overtakes it meanwhile
            budget = self._admit(r, q, hit, host_n, new_blocks, now, batch, budget)
        return budget

    def _hold_first_step(self, r: EngineRequest, hit_blocks: int, batch: list[tuple[EngineRequest, int]],
                         budget: int) -> bool:
        """Whether the policy's pick ``r`` waits one step because its chunk (the rest of the
        budget, or its whole prompt where that ends in the step) would lengthen a step that
        brings first tokens by more than the hold costs (``fairway.first_step``). A prompt that
        would end in the step is held once at most: the price counts one step's wait. O(batch)."""
        c = hit_blocks * self.config.block_size
        chunk = min(budget, self._cap)
        ends = r.target - c <= chunk
        if (ends and r.step_held) or not self.policy.may_hold_first_step(r.rid):
            return False
        p_tok, p_ctx, p_sq, d_seqs, d_ctx, first = _step_shape(batch)
        held = first_step_hold_pays(self.cost, first, len(self.policy) - 1, p_tok, p_ctx, p_sq,
                                    d_seqs, d_ctx, min(chunk, r.target - c), c)
        if held and ends:
            r.step_held = True
        return held

    def _strict_prefill(self) -> bool:
        """Whether the strictest tier has prefill to run: a request of it waits, or one running
        is not past its prompt. O(running)."""
        if self.policy.strict_waiting():
            return True
        lower = self.policy.lower_tier
        return any(_prefill_left(r) and not lower(r.spec.priority_class) for r in self.running)

    def _set_deadline(self, r: EngineRequest, deadline: float) -> None:
        self._wait_seq += 1
        r.wait_token = self._wait_seq
        heapq.heappush(self._due, (deadline, self._wait_seq, r.rid))

    def _make_room_for_due(self, now: float) -> None:
        """If the earliest overdue waiting request does not fit, preempt the newest running
        requests until it does (their computed blocks stay cached, and spill to the host tier)."""
        r = self._overdue_head(now)
        if r is None or r.generated:
            return  # only a first token is worth a preemption
        pool = self.pool
        hit, _, new_blocks = self._plan(r)
        while self.running and pool.free_after_touch(hit) < new_blocks:
            # decoding requests first (their first token is out), newest first
            victim = next((x for x in reversed(self.running) if x.generated > 0), self.running[-1])
            self._preempt(victim)
            hit, _, new_blocks = self._plan(r)

    def _overdue_head(self, now: float) -> EngineRequest | None:
        """The waiting request with the earliest deadline, if that deadline has passed; stale
        entries on top (admitted, aborted, or re-queued since) are dropped. Amortised O(log n)."""
        due = self._due
        while due and due[0][0] <= now:
            _, token, rid = due[0]
            r = self.reqs.get(rid)
            if r is None or r.wait_token != token or r.blocks:
                heapq.heappop(due)
                continue
            return r
        return None

    def _admit(self, r: EngineRequest, q: QueuedRequest, hit: list[int], host_n: int, new_blocks: int,
               now: float, batch: list[tuple[EngineRequest, int]], budget: int) -> int:
        """Commit one admission: take the hit, reload the host-tier continuation, allocate the
        rest, schedule its first chunk. Returns the budget left."""
        pool = self.pool
        bs = self.config.block_size
        adm = self.policy.admit(q.rid)
        if self.memory is not None:  # its prompt (``r.queued``, the record of this wait) until _unhold
            self.memory.hold(q.block_hashes)
        pool.touch(hit)
        n_hit = len(hit)
        reload: tuple[int, ...] = ()
        if host_n:
            reload = tuple(self._cacheable(r)[n_hit : n_hit + host_n])
            pool.host_touch(reload)
        r.blocks = list(hit) + pool.allocate(new_blocks)
        for k, h in enumerate(reload):
            pool.cache_block(r.blocks[n_hit + k], h)
        if r.demand:
            pool.add_demand(r.demand, QUEUE, -1)
            r.demand = ()
        self._flush_events()
        done = n_hit + host_n
        r.num_computed = done * bs
        r.n_hashed = done
        if host_n:
            # vLLM's offloading connector loads asynchronously: the request waits for its blocks
            # (one link, loads in admission order); the rest of the batch runs meanwhile
            load = host_n * bs * self._reload_s_per_token
            r.ready_s = max(now, self._link_free_s) + load
            self._link_free_s = r.ready_s
            self.reload_s += load
        if r.admitted_s < 0:
            r.admitted_s = now
            r.cached_tokens = r.num_computed
            r.host_tokens = host_n * bs
            r.lane = adm.lane
            r.promoted = adm.promoted
            self.gpu_hit_tokens += n_hit * bs
            self.host_hit_tokens += host_n * bs
            self.miss_tokens += r.spec.prompt_tokens - done * bs
        self.running.append(r)
        if self.listener is not None:
            self.listener.on_admitted(self.replica, r)
        if r.ready_s > now:
            return budget
        n = min(r.target - r.num_computed, budget, self._cap)
        batch.append((r, n))
        return budget - n

    # -- internals ---------------------------------------------------------------------------

    def _preempt(self, r: EngineRequest) -> None:
        self.running.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        if self.memory is not None:
            self._unhold(r)
        r.num_computed = 0
        r.n_hashed = 0
        r.preemptions += 1
        self.preemptions += 1
        self._enqueue(r)
        if self.listener is not None:
            self.listener.on_preempted(self.replica, r)

    def _held_prompts(self) -> list[Sequence[int]]:
        """The prompts the memory view holds: each running request's (``_admit`` holds it after the
        policy's admit and before the request joins ``running``). O(running)."""
        return [r.queued.block_hashes for r in self.running]  # type: ignore[union-attr]

    def _unhold(self, r: EngineRequest, finished: bool = False) -> None:
        """Running ``r`` stops: the prompt ``_admit`` held (its wait's record, ``r.queued``, which
        only a re-queueing replaces) leaves the memory view's running set, and, when it finished
        or was aborted, is wanted a while by a next turn, as the gate counts it."""
        hashes = r.queued.block_hashes  # type: ignore[union-attr]
        self.memory.release(hashes)  # type: ignore[union-attr]
        if finished:
            self.memory.finished(hashes)  # type: ignore[union-attr]

    def _flush_events(self) -> None:
        pool = self.pool
        events = pool.drain_events()
        tier = pool.drain_tier_events() if pool.tier_events else None  # host tier only
        listener = self.listener
        if listener is not None:
            if events:
                listener.on_kv_events(self.replica, events)
            if tier:
                listener.on_kv_tier_events(self.replica, tier)  # which hashes are host-only: after the KV events
        if not events:
            return
        run: list[int] = []
        kind = events[0][0]
        for stored, h in events:
            if stored != kind:
                self._deliver(kind, run)
                run = []
                kind = stored
            run.append(h)
        self._deliver(kind, run)

    def _deliver(self, stored: bool, hashes: list[int]) -> None:
        if stored:
            self.policy.on_blocks_stored(hashes)
        else:
            self.policy.on_blocks_removed(hashes)
            if self.memory is not None:
                self.memory.on_blocks_removed(hashes)
