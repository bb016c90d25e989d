"""The replica's admission gate: a local Fairway queue in front of an engine.

Why: an engine serves its own waiting queue first-come-first-served (vLLM) and admits whatever
fits. To make the *order* Fairway's, requests wait here, in the same ``QueuePolicy`` object the
simulator runs, and enter the engine only when it has room; the engine's own waiting queue stays
near empty. "Room" is, in order:

1. fewer than ``max_num_seqs`` requests in the engine;
2. less than one step's token budget (``max_num_batched_tokens``, or ``prefill_budget_tokens``)
   of admitted prompt tokens still to prefill, so the engine always has a full step of prefill
   work and at most about one step of backlog that the gate no longer orders (with an engine
   that serves the strictest tier's prefill first, ``tier_of``: the admitted backlog of the
   pick's tier and stricter ones only, so an interactive request does not wait here for a step
   of batch backlog the engine will pause for it);
3. the head request's KV blocks fit (``engine.can_fit``); if not, the head waits and nothing
   behind it jumps ahead (vLLM's head-of-line rule), so a large request is never starved by
   small ones slipping into freed memory.

With ``oldest_first_after_s`` set, a request that has waited that long goes before the policy's
pick (the oldest first, ahead of the tenants' fair queueing too), and rule 3 applies to it: an
age bound on the order, which the engine model measures as ``guard=all`` (docs/benchmarks.md 2.6).

The queue is bounded twice: beyond ``max_queue`` waiting requests, or once the estimated wait of
the queue reaches ``max_queue_wait_s``, a new one is refused at once with ``Overloaded`` (HTTP 429
with that estimate as Retry-After), never parked. The estimate is the queued prefill work (the
policy's, in the cost model's seconds) divided by the rate at which the gate has been admitting
such work out of a backlog (``replicas/drain.py``: measured, so decode steps, a slower engine or a
wrong profile are in it). The second bound is the one that keeps the wait of accepted requests, and the backlog an
overload leaves behind, bounded: a count of waiting requests says little when their prompts
differ 100x. A client that goes away while waiting is removed from the queue.

With API keys, each tenant has a queue of its own (``replicas/tenants.py``): the next admission
is the policy's choice within the tenant that has received the least prefill service, so one
tenant's flood cannot starve another's requests; and the wait bound counts, for a new request,
only the work it would wait for under that fair queueing (its tenant's queue and the others'
equal share), so a flood is refused while a quiet tenant is not.

Each request's length is checked here, once (an empty prompt, ``max_tokens < 1``, or prompt +
``max_tokens`` over the engine's ``max_model_len``: ``RequestTooLarge``, HTTP 400); the engines do
not check it again.

A stalled engine (requests in it, no output from any of them for ``stall_timeout_s`` on the
injected clock, times the engine's ``time_scale``: a sim engine slowed to ``speed`` 0.1 takes ten
times as long over every step, so its bound is ten times as long; a faster one keeps the bound)
is detected by the gate's ticker: the requests it holds end at once with ``EngineStalled`` (HTTP
504), new ones are refused with 503 while it lasts, ``stalled`` is set (the replica's health
check then fails, so Serve replaces it), and the first output after it clears the state.

The policy's view of the cache is the engine's (exact for ``sim``, the engine's estimate for
``vllm``), kept current by the engine's stored/removed events (``QueuePolicy`` hit tracking).

Complexity: a pump is O(admitted) policy decisions, each O(waiting) vectorised.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fairway.clock import Clock
from fairway.first_step import first_step_hold_pays
from fairway.memory_view import KVMemoryView
from fairway.policies.base import Admission, QueuedRequest, QueuePolicy
from fairway.protocol import (
    Engine,
    EngineFailed,
    EngineStalled,
    GenerateCall,
    Overloaded,
    PastWaitBound,
    ReplicaError,
    ReplicaRoutingStats,
    RequestTooLarge,
    TokenChunk,
)
from replicas.drain import DrainRate
from replicas.tenants import TenantQueues

logger = logging.getLogger("ray.serve")

RECENT_FEEDBACK = 512  # finished requests whose cached tokens the routing stats carry
PUMP_TICK_S = 0.02  # safety re-check while requests wait (engines without step callbacks)


class GateConfig(BaseModel):
    """The gate's limits: the one declaration of these settings and their defaults (the YAML's
    ``replica:`` block, ``replicas/deployment.py:ReplicaOptions``, extends it)."""

    model_config = ConfigDict(extra="forbid")

    max_queue: int = Field(512, ge=1, description="waiting requests beyond which new ones get 429")
    prefill_budget_tokens: int | None = Field(None, ge=1, description="admitted-but-unprefilled tokens allowed "
                                              "in the engine; null: the engine's max_num_batched_tokens")
    stall_timeout_s: float = Field(15.0, gt=0, description="no engine output for this long with requests in "
                                                           "it: fail them with 504, report unhealthy (in the "
                                                           "engine's time: a sim engine with speed < 1 "
                                                           "waits 1 / speed times as long)")
    max_queue_wait_s: float | None = Field(5.0, gt=0, description="estimated wait of the queue (wall seconds: "
                                           "its prefill work over the rate the engine works it off) beyond "
                                           "which new requests get 429; null: no bound")
    tenant_recent_s: float = Field(30.0, gt=0, description="with tenant_fair: a tenant seen this recently that "
                                                        "holds less of the engine is owed one slot and room for "
                                                        "its largest recent prompt")
    oldest_first_after_s: float | None = Field(None, gt=0, description="a request that has waited this long "
                                               "(wall seconds) is admitted before the policy's pick, oldest "
                                               "first (an age bound on the queue order, for memory-bound "
                                               "agentic loads; docs/benchmarks.md 2.6); null: off")


class AdmissionGate:
    """Fairway queue + admission into ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        policy: QueuePolicy,
        clock: Clock,
        config: GateConfig | None = None,
        replica: str = "replica",
        stats: Any = None,
        policy_factory: Callable[[], QueuePolicy] | None = None,
        wait_bound_s: Callable[[str], float | None] | None = None,
        tier_of: Callable[[str], int] | None = None,
    ) -> None:
        """``tier_of`` (a class name -> its tier, lower first): given when the engine itself
        serves the strictest tier's prefill first (the sim engine's ``tiers``); rule 2 then counts,
        for a request of tier t, only the admitted prefill of tiers up to t (module docstring)."""
        self.engine = engine
        self.tier_of = tier_of
        # the tenants' queues, each ordered by ``policy``'s kind (``policy`` serves requests without a key)
        self.config = config or GateConfig()
        if not engine.time_scale > 0:
            raise ValueError(f"the engine's time_scale must be > 0, got {engine.time_scale!r}")
        #: the watchdog's bound on the injected clock: ``stall_timeout_s`` in the engine's time,
        #: never below it (a faster-than-real sim engine's host work and event loop do not speed up)
        self.stall_bound_s = self.config.stall_timeout_s * max(1.0, engine.time_scale)
        self.policy = TenantQueues(policy, policy_factory, block_size=engine.block_size,
                                   recent_s=self.config.tenant_recent_s)
        self.clock = clock
        self.replica = replica
        self.stats = stats  # a observability.stats.FairwayStats, or None
        self._waiting: dict[int, asyncio.Future] = {}
        self._request_ids: dict[int, str] = {}
        self._seq = 0
        self._promotions_seen = 0
        self._yields_seen = 0
        self._credits_seen = 0
        self.recent_cached: OrderedDict[str, int] = OrderedDict()
        self._pending_prefill = 0  # uncached prompt tokens admitted and without a first token yet
        self._pending_tier: dict[int, int] = {}  # with tier_of: those tokens by tier
        self._tier: dict[int, int] = {}  # with tier_of: admitted rid without a first token -> its tier
        self._admitted: dict[int, str] = {}  # in the engine (admitted, not finished): rid -> request id
        # of those, without a first token: rid -> (admission wall time, uncached, cached prompt tokens)
        self._prefilling: dict[int, tuple[float, int, int]] = {}
        self._cost = policy.cost  # prices the first-step hold (``fairway.first_step``)
        # waiting rids the first-step hold has kept out so far -> the admitted prefills whose
        # first tokens it first waited for
        self._held_first_step: dict[int, frozenset[int]] = {}
        self.first_step_holds = 0  # requests held out of the step in the engine (each once)
        self.admitted = 0
        self.finished = 0
        self.rejected = 0
        self.cancelled = 0  # requests whose consumer left before they finished
        self.stalled = False  # the engine holds requests and produced nothing for stall_bound_s
        self.stalls = 0
        self._progress_at = clock.now()  # the engine's last output (or its last idle moment)
        self._deadlines: dict[int, Any] = {}  # admitted rid -> its asyncio.Timeout (fired on a stall)
        self._ticker: asyncio.Task | None = None
        self.drain = DrainRate()  # cost-model prefill seconds worked off per busy second
        self.wait_bound_s = wait_bound_s  # a request's class -> its wait bound (None: none); with classes
        self._bounds: list[tuple[float, int]] = []  # (wall deadline, rid) of waiting requests; heap, lazy
        self.past_bound = 0  # requests answered 429 because they waited past their class's bound
        def cached(h: int) -> bool:
            return engine.cached_prefix_blocks((h,)) == 1

        self.policy.attach_cache(cached)
        # a policy that reads the KV memory (Fairway's memory guard): the view counts what the
        # engine does not say (fairway/memory_view.py) on top of its free-block count, while the
        # policy needs it
        self.memory: KVMemoryView | None = None
        if self.policy.wants_memory_view():
            self.memory = KVMemoryView(lambda: engine.stats().kv_blocks_free, clock, self.policy.memory_horizon_s(),
                                       cached=cached, running=self.policy.held_prompts, on_demand=True)
            self.policy.attach_memory(self.memory)
        engine.set_cache_listener(self.policy.on_blocks_stored, self._on_blocks_removed)
        engine.on_step = self.pump

    def _on_blocks_removed(self, hashes: Iterable[int]) -> None:
        """The engine's removed events: to the policy, and to the memory view while it counts."""
        if self.memory is None or not self.memory.counting:
            self.policy.on_blocks_removed(hashes)
            return
        hs = list(hashes)
        self.policy.on_blocks_removed(hs)
        self.memory.on_blocks_removed(hs)

    async def start(self) -> None:
        await self.engine.start()
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ReplicaError("replica shutting down"))
        await self.engine.shutdown()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(PUMP_TICK_S)
            if self._waiting:
                self.pump()
                self._shed()
            self._watch()
            self._publish()

    def _watch(self) -> None:
        """Stall detection (see the module docstring). O(requests in the engine) on a stall."""
        now = self.clock.now()
        if not self._admitted:
            self._progress_at = now
            return
        if self.stalled or now - self._progress_at < self.stall_bound_s:
            return
        self.stalled = True
        self.stalls += 1
        logger.error("replica %s: engine stalled (no output for %.1f s with %d requests in it); failing them",
                     self.replica, now - self._progress_at, len(self._admitted))
        loop_now = asyncio.get_running_loop().time()
        for timeout in self._deadlines.values():
            timeout.reschedule(loop_now)

    def _shed(self) -> None:
        """Answer the waiting requests whose class's wait bound has passed (``PastWaitBound``,
        429): still unadmitted at their bound, they would miss it anyway, and the engine's time
        goes to requests that can still meet theirs. O(due log n)."""
        now = time.time()
        shed = 0
        while self._bounds and self._bounds[0][0] <= now:
            _, rid = heapq.heappop(self._bounds)
            fut = self._waiting.get(rid)
            if fut is None or fut.done():
                continue
            self._drop(rid)
            shed += 1
            self._reject("past_bound")
            fut.set_exception(PastWaitBound(f"replica {self.replica}: the request waited in its queue past its "
                                            "class's wait bound; retry later", retry_after_s=max(1.0, round(
                                                self.queue_wait_s(), 1))))
        if shed:  # the queue shrank: the drain rate's backlog state (the pump observed it otherwise)
            self.past_bound += shed
            self.drain.observe(self.clock.now(), bool(self._waiting))

    def _progress(self) -> None:
        self._progress_at = self.clock.now()
        if self.stalled:
            self.stalled = False
            logger.warning("replica %s: engine making progress again", self.replica)

    # -- admission ---------------------------------------------------------------------------

    def _has_room(self) -> bool:
        # Counted here, not read from the engine: an admitted request reaches the engine only
        # when its coroutine next runs, so the engine's own figures lag this loop.
        if len(self._admitted) >= self.engine.max_num_seqs:
            return False
        # with tier_of, rule 2 depends on the pick's tier: ``pump`` checks it per pick
        return self.tier_of is not None or self._pending_prefill < self._budget()

    def _pending_upto(self, tier: int) -> int:
        """Admitted prefill tokens without a first token, of tiers up to ``tier``. O(tiers)."""
        return sum(n for t, n in self._pending_tier.items() if t <= tier)

    def _budget(self) -> int:
        """Admitted-but-unprefilled tokens the engine may hold (one step's worth by default)."""
        return self.config.prefill_budget_tokens or self.engine.max_num_batched_tokens

    def pump(self) -> int:
        """Admit waiting requests while the engine has room; return how many."""
        n = 0
        owing: set[str] = set()  # tenants that must leave room for quieter ones: not this pass
        while self._waiting and self._has_room():
            overdue = self._overdue()
            q = overdue or self.policy.select(skip=owing)
            if q is None:
                break
            tier = self.tier_of(q.priority_class) if self.tier_of is not None else 0
            # rule 2: with tier_of, for the pick's tier (the strictest waiting: the policy's order)
            pending = self._pending_upto(tier) if self.tier_of is not None else self._pending_prefill
            if pending >= self._budget():
                break
            if self._waiting[q.rid].done():
                # its task was cancelled (the client left): ``Task.cancel`` cancelled the future at
                # once, the task has not run yet. Admitting it would leave it counted in the engine
                # for good (the task, finding its future cancelled, releases nothing): drop it
                self._drop(q.rid)
                continue
            tokens = 0
            if overdue is None:
                # room kept for quieter tenants (replicas/tenants.py): a slot each, their next
                # prompt in KV memory, and up to half of the prefill budget (so their prefill does
                # not queue behind a full budget of the others' inside the engine)
                tenant = self.policy.tenant_of(q.rid)
                tokens, slots = self.policy.reserve(tenant, self.clock.now())
                if slots and (len(self._admitted) + slots >= self.engine.max_num_seqs
                              or pending + min(tokens, self._budget() // 2) >= self._budget()):
                    owing.add(tenant)
                    continue
            if not self.engine.can_fit(q.prompt_tokens + tokens, q.block_hashes):
                if tokens and self.engine.can_fit(q.prompt_tokens, q.block_hashes):
                    owing.add(tenant)  # it fits, but only in the room kept for the quieter tenants
                    continue
                break  # head-of-line: wait for memory, let nobody overtake
            if overdue is None and self._prefilling and self._hold_first_step(q, pending):
                if q.rid not in self._held_first_step:
                    self._held_first_step[q.rid] = frozenset(self._prefilling)
                    self.first_step_holds += 1
                    if self.stats is not None:
                        self.stats.inc_first_step_holds(replica=self.replica)
                break  # until the step in the engine ends: nothing overtakes it meanwhile
            self._held_first_step.pop(q.rid, None)
            adm = self.policy.admit(q.rid)
            self.drain.took(self.clock.now(), adm.est_prefill_s)
            self._pending_prefill += adm.prompt_tokens - adm.cached_tokens
            if self.tier_of is not None:
                self._tier[q.rid] = tier
                self._pending_tier[tier] = self._pending_tier.get(tier, 0) + adm.prompt_tokens - adm.cached_tokens
            self._admitted[q.rid] = self._request_ids.pop(q.rid, "")
            self._prefilling[q.rid] = (time.time(), adm.prompt_tokens - adm.cached_tokens, adm.cached_tokens)
            fut = self._waiting.pop(q.rid)
            if not fut.done():
                fut.set_result(adm)
            n += 1
        self.drain.observe(self.clock.now(), bool(self._waiting))
        return n

    def _hold_first_step(self, q: QueuedRequest, pending: int) -> bool:
        """Whether the pick ``q`` stays out of the engine until the admitted prefills get their
        first token (``fairway.first_step``, as the engine model prices it): its chunk (the rest
        of the step's budget, or its whole prompt where that ends in the step) would lengthen the
        step that ends theirs by more than holding it costs. The step is the admitted prefills
        (each ends in it: rule 2 keeps them within one step's budget, unless the engine caps a
        request's chunk, ``long_prefill_token_threshold``: then one longer than the cap runs a
        chunk of it and ends later) and the decodes of the rest of the engine's requests, their
        context unknown here. A prompt that would end in the step is held for one step's first
        tokens at most: not again once others were admitted after it was first held. A pick past
        the age bound (``oldest_first_after_s``) is never held. O(admitted without a first token)."""
        budget = self._budget()
        if pending >= budget or not self.policy.may_hold_first_step(q.rid):
            return False
        cap = self.engine.long_prefill_token_threshold  # the engine's chunk per request; 0: none
        room = budget - pending
        if 0 < cap < room:
            room = cap
        cached = self.policy.cached_tokens(q.rid)
        ends = q.prompt_tokens - cached <= room
        held_for = self._held_first_step.get(q.rid)
        if ends and held_for is not None and not held_for.issuperset(self._prefilling):
            return False  # it was held for other first tokens before
        p_tok = p_ctx = p_sq = m = 0
        for _, n, c in self._prefilling.values():
            if 0 < cap < n:
                n = cap  # a chunk of it: no first token in this step
            else:
                m += 1
            p_tok += n
            p_ctx += n * c
            p_sq += n * n
        return first_step_hold_pays(self._cost, m, len(self._waiting) - 1, p_tok, p_ctx, p_sq,
                                    len(self._admitted) - len(self._prefilling), 0,
                                    min(room, q.prompt_tokens - cached), cached)

    def _drop(self, rid: int) -> None:
        """Waiting ``rid`` leaves the queue unadmitted (its consumer left). O(1) plus the
        policy's removal."""
        del self._waiting[rid]
        self._request_ids.pop(rid, None)
        self._held_first_step.pop(rid, None)
        self.policy.remove(rid)

    def _overdue(self) -> QueuedRequest | None:
        """The oldest waiting request once it has waited ``oldest_first_after_s``, else None.
        O(1): ``_waiting`` is in arrival order."""
        bound = self.config.oldest_first_after_s
        if bound is None or not self._waiting:
            return None
        q = self.policy.get(next(iter(self._waiting)))
        return q if self.clock.now() - q.arrival_s >= bound else None

    def _full(self, tenant: str = "", priority_class: str = "") -> tuple[str, float]:
        """Why the queue takes no more requests of ``tenant`` and ``priority_class``
        (``max_queue`` waiting, or an estimated wait of ``max_queue_wait_s``) and the estimated
        wait; ("", wait) if it takes it. O(waiting) for the work's sums."""
        cfg = self.config
        wait = self.queue_wait_s(tenant, priority_class)
        if len(self._waiting) >= cfg.max_queue:
            return f"{cfg.max_queue} waiting", wait
        if self._at_wait_bound(wait):
            return f"an estimated {wait:.1f} s of queue, the bound is {cfg.max_queue_wait_s:g} s", wait
        return "", wait

    def _at_wait_bound(self, wait: float) -> bool:
        """Requests wait, and ``wait`` (an estimate from ``queue_wait_s``) reaches ``max_queue_wait_s``."""
        bound = self.config.max_queue_wait_s
        return bound is not None and bool(self._waiting) and wait >= bound

    def queue_wait_s(self, tenant: str | None = None, priority_class: str = "") -> float:
        """Estimated wall seconds until the engine has started everything waiting here (None), or
        everything a new request of ``tenant`` and ``priority_class`` waits for (its own tenant's
        queue and the others' equal share, the work ordered ahead of its class:
        ``TenantQueues.work_ahead_s``). O(waiting)."""
        work = (self.policy.queued_prefill_s() if tenant is None
                else self.policy.work_ahead_s(tenant, priority_class))
        return self.drain.wait_s(work)

    async def submit(self, call: GenerateCall) -> AsyncIterator[TokenChunk]:
        """Queue ``call``, wait for admission, stream its tokens. Raises ``Overloaded`` at once
        when the queue is full and ``RequestTooLarge`` for a request the engine can never hold."""
        n = len(call.prompt_token_ids)
        if n < 1 or call.max_tokens < 1:
            self._reject("bad_request")
            raise RequestTooLarge("empty prompt" if n < 1 else "max_tokens must be >= 1")
        if n + call.max_tokens > self.engine.max_model_len:
            self._reject("too_long")
            raise RequestTooLarge(
                f"prompt ({n} tokens) + max_tokens ({call.max_tokens}) exceeds the model's context "
                f"length {self.engine.max_model_len}")
        if self.stalled:
            self._reject("stalled")
            raise EngineFailed(f"replica {self.replica}: engine stalled; retry", retry_after_s=1.0)
        self.drain.observe(self.clock.now(), bool(self._waiting))
        full, wait = self._full(call.tenant, call.priority_class)
        if full:
            self._reject("queue_full")
            raise Overloaded(f"replica {self.replica} queue is full ({full})", retry_after_s=max(1.0, round(wait, 1)),
                             replica=self.replica)
        if self.stats is not None:
            self.stats.observe_dispatch(time.time() - call.arrival_s, replica=self.replica)
        rid = self._seq
        self._seq += 1
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self._request_ids[rid] = call.request_id
        bound = self.wait_bound_s(call.priority_class) if self.wait_bound_s is not None else None
        if bound is not None:
            heapq.heappush(self._bounds, (call.waited_from + bound, rid))
        self.policy.add(QueuedRequest(rid=rid, arrival_s=self.clock.now(), prompt_tokens=n,
                                      block_hashes=call.block_hashes, seq=rid,
                                      output_tokens=call.max_tokens, priority_class=call.priority_class),
                        call.tenant)
        self.pump()
        try:
            if call.ack:  # the router holds it until a gate takes it: say so now, not at its first token
                yield TokenChunk(token_ids=[], accepted=True, replica=self.replica)
            adm: Admission = await fut
        except BaseException as e:
            if not isinstance(e, PastWaitBound):
                self.cancelled += 1
            if rid in self._waiting:
                self._drop(rid)
                self.drain.observe(self.clock.now(), bool(self._waiting))
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), prefilled=False)  # admitted, then cancelled
            raise
        self.admitted += 1
        self._count_policy_events()
        if self.stats is not None:
            self.stats.observe_queue_wait(adm.lane, adm.waited_s, replica=self.replica)
        status = "error"
        progress = {"prefilled": False}
        try:
            async for chunk in self._stream_until_stall(call, adm, progress):
                yield chunk
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"  # the consumer left; the engine aborts the request
            self.cancelled += 1
            raise
        finally:
            self._release(adm, progress["prefilled"])
            self.finished += 1
            if self.stats is not None:
                self.stats.inc_requests(adm.lane, status, replica=self.replica)
            self.pump()

    def _release(self, adm: Admission, prefilled: bool) -> None:
        if not prefilled:
            self._prefill_over(adm)
        self._admitted.pop(adm.rid, None)  # after _prefilling: its keys are always admitted ones
        self.policy.release(adm.rid)

    def _prefill_over(self, adm: Admission) -> None:
        """``adm``'s prefill no longer occupies the engine (first token out, or it left first):
        it leaves the pending prefill tokens and the prefilling list the stats report."""
        self._pending_prefill -= adm.prompt_tokens - adm.cached_tokens
        self._prefilling.pop(adm.rid, None)
        tier = self._tier.pop(adm.rid, None)
        if tier is not None:
            self._pending_tier[tier] -= adm.prompt_tokens - adm.cached_tokens

    async def _stream_until_stall(self, call: GenerateCall, adm: Admission,
                                  progress: dict[str, bool]) -> AsyncIterator[TokenChunk]:
        """``_stream``, ended with ``EngineStalled`` when the watchdog finds the engine stalled.
        While the request waits for the engine (not while its consumer holds a chunk), its
        ``asyncio.Timeout`` is in ``_deadlines``, where ``_watch`` fires it: no task or timer per
        chunk."""
        gen = self._stream(call, adm, progress)
        try:
            async with asyncio.timeout(None) as t:
                while True:
                    if self.stalled:  # stalled while the consumer held the last chunk
                        t.reschedule(asyncio.get_running_loop().time())
                    self._deadlines[adm.rid] = t
                    try:
                        chunk = await anext(gen)
                    except StopAsyncIteration:
                        return
                    finally:
                        del self._deadlines[adm.rid]
                    yield chunk
        except TimeoutError:
            raise EngineStalled(f"replica {self.replica}: the engine made no progress for "
                                f"{self.stall_bound_s:g} s; the request was stopped, retry it") from None
        finally:
            await gen.aclose()

    async def _stream(self, call: GenerateCall, adm: Admission, progress: dict[str, bool]) -> AsyncIterator[TokenChunk]:
        n = len(call.prompt_token_ids)
        first = True
        cached = 0
        ttft = 0.0
        produced = 0
        admitted_at = time.time()
        async for out in self.engine.generate(call):
            self._progress()
            produced += len(out.token_ids)
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            chunk = TokenChunk(token_ids=list(out.token_ids), finished=out.finished,
                               finish_reason=out.finish_reason, completion_tokens=produced, logprobs=out.logprobs,
                               prompt_logprobs=out.prompt_logprobs)
            if first and out.token_ids:
                first = False
                ttft = max(0.0, time.time() - call.arrival_s)
                if self.stats is not None:
                    self.stats.observe_ttft(adm.lane, ttft, replica=self.replica)
                    self.stats.observe_prefill(adm.lane, time.time() - admitted_at, replica=self.replica)
                self._fill(chunk, n, cached, adm, ttft)
                progress["prefilled"] = True
                self._prefill_over(adm)
                self.pump()  # its prefill is done: room for the next one
            if out.finished:
                self._fill(chunk, n, cached, adm, ttft)
                self.recent_cached[call.request_id] = cached
                while len(self.recent_cached) > RECENT_FEEDBACK:
                    self.recent_cached.popitem(last=False)
            yield chunk
            if out.finished:
                return
        raise ReplicaError(f"engine ended request {call.request_id} without finishing it")

    def _fill(self, chunk: TokenChunk, n: int, cached: int, adm: Admission, ttft: float) -> None:
        chunk.prompt_tokens = n
        chunk.cached_tokens = cached
        chunk.lane = adm.lane
        chunk.promoted = adm.promoted
        chunk.queue_wait_s = adm.waited_s
        chunk.ttft_s = ttft
        chunk.replica = self.replica

    # -- reporting ---------------------------------------------------------------------------

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.stats is not None:
            self.stats.inc_reject(reason, replica=self.replica)

    def _count_policy_events(self) -> None:
        """The policy's promotions, memory-guard yields and lost-context credits since the last
        call, to their counters."""
        total = getattr(self.policy, "promotions", 0)
        if total > self._promotions_seen and self.stats is not None:
            self.stats.inc_promotions(total - self._promotions_seen, replica=self.replica)
        self._promotions_seen = total
        yields = getattr(self.policy, "yields", 0)
        if yields > self._yields_seen and self.stats is not None:
            self.stats.inc_guard_yields(yields - self._yields_seen, replica=self.replica)
        self._yields_seen = yields
        credits = getattr(self.policy, "lost_credits", 0)
        if credits > self._credits_seen and self.stats is not None:
            self.stats.inc_lost_credits(credits - self._credits_seen, replica=self.replica)
        self._credits_seen = credits

    def _publish(self) -> None:
        if self.stats is None:
            return
        self._count_policy_events()
        lanes = self.policy.lane_sizes() or {"": len(self.policy)}
        for lane, k in lanes.items():
            self.stats.set_queue_depth(lane, k, replica=self.replica)
        queued = self.policy.queued_prefill_s()
        self.stats.set_queued_prefill(queued, replica=self.replica)
        self.drain.observe(self.clock.now(), bool(self._waiting))  # an idle spell's decay, up to now
        self.stats.set_queue_wait_estimate(self.drain.wait_s(queued), replica=self.replica)
        self.stats.set_drain_rate(self.drain.rate(), replica=self.replica)
        st = self.engine.stats()
        self.stats.set_engine(self.replica, running=st.running, waiting=len(self.policy),
                              kv_usage=st.kv_usage, preemptions_total=self.engine.preemptions)

    def routing_stats(self) -> ReplicaRoutingStats:
        st = self.engine.stats()
        queued = self.policy.queued_prefill_s()
        self.drain.observe(self.clock.now(), bool(self._waiting))  # an idle spell's decay, up to now
        return ReplicaRoutingStats(
            taken_at=time.time(),
            kv_usage=st.kv_usage,
            kv_blocks_total=st.kv_blocks_total,
            max_num_seqs=self.engine.max_num_seqs,
            recent_cached=dict(self.recent_cached),
            waiting_ids=list(self._request_ids.values()),
            prefilling={self._admitted[rid]: t for rid, (t, _, _) in self._prefilling.items()},
            admitted_ids=list(self._admitted.values()),
            stalled=self.stalled,
            full=self._at_wait_bound(self.drain.wait_s(queued)),
            drain_rate=self.drain.rate(),
        )
