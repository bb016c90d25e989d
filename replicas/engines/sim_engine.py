"""The ``sim`` engine: the simulator's engine model (``fairway/engine/model.py``) running in real time.

Why: the cluster must run on a laptop or a CI box with no GPU, yet behave like a vLLM replica:
same block hashing (``fairway/hashing.py``), the same prefix cache with LRU eviction of free
blocks, the same per-step token budget, memory-bound admission and preemption, and step times
from the H200-calibrated cost model. This host drives ``EngineModel`` with the wall clock: it
schedules a step, sleeps for the modelled step time (divided by ``speed``), applies the step and
streams each request's new tokens. It is the engine model, not a stub: every number it reports
(cached tokens, TTFT, KV usage) comes from the model's state.

Pacing (``pacing``): ``"deadline"`` (default) ends each step at an absolute deadline, the previous
step's deadline + the modelled step time (from now after an idle period), so the time spent
emitting tokens, pumping the gate and the event loop's sleep overshoot (a sizeable fraction of a
short decode step on a busy box) is absorbed instead of added to every step; a step that starts
late sleeps less, down to zero, and a deficit beyond ``max_catchup_s`` is written off (counted in
``timing()["written_off_s"]``) rather than repaid in a burst. ``"sleep"`` is the plain
``sleep(step time)``, which runs slow by that overhead. ``timing()`` reports modelled vs wall
busy time and the per-step lateness, so a run can show how far the real-time loop kept up.

The gate in front (``replicas/gate.py``) orders admission with the Fairway queue; inside, the
engine serves what it was given first-come-first-served, as vLLM's own waiting queue does. With
``tiers`` (the replica's ``strict_tiers``) it serves its waiting queue by class tier instead, as
vLLM's priority scheduling does, and pauses lower tiers' prefill while the strictest tier has
prefill to run, so an interactive prompt is not computed in steps shared with batch prefill
chunks (stock vLLM has no such rule: it runs its running requests' prefill first, whatever their
priority).

A request whose consumer stops reading (the client disconnected, so Serve cancelled the call) is
aborted in the model at once: it leaves the queue or the running batch and its KV blocks are freed,
as vLLM's ``abort`` does.

End of sequence (``eos_mean_tokens``, default 256): a model ends its answer when it samples its
end-of-sequence token, not at ``max_tokens``. A text-less engine has no such token, so each
request's natural length is drawn from its generator: geometric with mean ``eos_mean_tokens`` (a
stop chance of 1 / mean at every token, the memoryless stop of a model whose EOS probability does
not depend on the text). The request ends there with ``finish_reason`` "stop" when that comes
before ``max_tokens``, else at ``max_tokens`` with "length"; ``ignore_eos`` (vLLM's, which the
load generator and the benchmarks send) runs it to ``max_tokens``, and ``eos_mean_tokens=0`` does
so for every request; ``min_tokens`` (vLLM's) allows no end before that many tokens, the same stop
chance applying from there on. The end-of-sequence token itself is not emitted. So a chat request without
``max_tokens`` (whose bound is the rest of the context) answers in about 256 tokens, as a chat
model's would, rather than streaming tens of thousands.

Generated tokens are pseudo-random ids from a per-request seeded generator (ids 16..vocab-1, or
only the request's ``allowed_token_ids``, vLLM's), standing for samples at any ``temperature`` /
``top_p`` / ``top_k`` / ``min_p``; a request with a
``seed`` gets ids drawn from that seed and its prompt, so the same seed and prompt give the same output (OpenAI's
``seed``). The penalties, ``logit_bias``, ``bad_words`` and a JSON ``structured_output`` need a
distribution to change or constrain, which a text-less engine has not: a request that sets one to other than its
no-op value is refused
(``UnsupportedParameter``, HTTP 400 naming it). The output's blocks are hashed into the prefix
cache like any other, so a follow-up turn that sends the previous output back hits it. Complexity
per step: O(batch) plus the engine model's own.

Streaming: with the replica's ``stream_interval_s`` (``replicas/stream.py``) a request's tokens
after its first wait in its output list until that long after its previous output, or its finish,
and leave merged: its consumer (the gate's stream, the replica's generator, Ray's transport) wakes
once per interval instead of once per step, which was the replica's largest Python cost per token.

Host KV tier (off by default): ``host_kv_blocks`` > 0 (and ``host_link_bytes_per_s``, default
50e9) give the engine model a host (CPU) tier: evicted blocks are kept there and reloaded at the
link's speed. Its tier events (which hashes are host-only) go to ``set_tier_listener``'s
listener, and ``host_only_hashes`` lists that set, so the routers' exact view tells a GPU hit, a
host hit and a miss apart (``replicas/kv_publisher.py``).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fairway.clock import Clock, MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.engine.model import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    EngineConfig,
    EngineListener,
    EngineModel,
    EngineRequest,
)
from fairway.hashing import HashState, salt_seed
from fairway.policies import make_policy
from fairway.policies.classes import ClassesConfig
from fairway.protocol import (
    Engine,
    EngineFailed,
    EngineOutput,
    EngineStats,
    GenerateCall,
    RequestTooLarge,
    UnsupportedParameter,
)
from fairway.request import RequestSpec


def check_sim_params(call: GenerateCall) -> None:
    """Refuse what a text-less engine cannot honour (module docstring), naming the parameter."""
    for name, value, noop in (("frequency_penalty", call.frequency_penalty, 0.0),
                              ("presence_penalty", call.presence_penalty, 0.0),
                              ("repetition_penalty", call.repetition_penalty, 1.0)):
        if value != noop:
            raise UnsupportedParameter(f"{name} is not supported by the sim engine (its tokens are not sampled "
                                       f"from a distribution a penalty could change); use {noop:g} or omit it",
                                       param=name)
    if call.logit_bias:
        raise UnsupportedParameter("logit_bias is not supported by the sim engine (its tokens are not sampled "
                                   "from logits); omit it", param="logit_bias")
    if call.logprobs is not None:
        raise UnsupportedParameter("logprobs is not supported by the sim engine (its tokens are not sampled "
                                   "from a distribution that has log probabilities); omit it", param="logprobs")
    if call.prompt_logprobs is not None:
        raise UnsupportedParameter("prompt_logprobs is not supported by the sim engine (it computes no "
                                   "distribution over the prompt's tokens); omit it", param="prompt_logprobs")
    if call.bad_words:
        raise UnsupportedParameter("bad_words is not supported by the sim engine (its tokens have no text to "
                                   "keep a word out of); omit it", param="bad_words")
    if call.structured_output:
        param = call.structured_output_param
        what, instead = CONSTRAINTS.get(param, CONSTRAINTS["response_format"])
        raise UnsupportedParameter(f"{what} is not supported by the sim engine (its tokens are not sampled from "
                                   f"logits a grammar could constrain); use {instead} or a vLLM engine", param=param)


#: An output constraint the sim engine refuses, by the parameter it came from: (what, what to send instead).
CONSTRAINTS = {
    "response_format": ("response_format json_object / json_schema", "{\"type\": \"text\"}"),
    "tool_choice": ("a tool_choice that forces a call (required, or a named function)", "tool_choice \"none\""),
    "structured_outputs": ("structured_outputs", "no structured_outputs"),
}


@dataclass(slots=True)
class _Live:
    """One request in the engine: its output ids and the queue its tokens go to."""

    rid: int
    output_ids: list[int]
    finish_reason: str = "length"  # "stop": its drawn end of sequence came before max_tokens
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0
    cached_sent: bool = False
    hold_until: float = 0.0  # later tokens wait for this time (``stream_interval_s``) or the finish


class SimEngine(Engine, EngineListener):
    """``Engine`` protocol over ``EngineModel`` in real time (see the module docstring)."""

    coalesces = True  # _emit holds a stream's later tokens for stream_interval_s

    def __init__(
        self,
        profile: str = DEFAULT_PROFILE,
        block_size: int = 16,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_blocks: int | None = None,
        max_model_len: int = 32768,
        speed: float = 1.0,
        vocab_size: int = 4096,
        seed: int = 0,
        clock: Clock | None = None,
        pacing: str = "deadline",
        max_catchup_s: float = 0.1,
        host_kv_blocks: int = 0,
        host_link_bytes_per_s: float = 50e9,
        tiers: ClassesConfig | None = None,
        eos_mean_tokens: int = 256,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """``eos_mean_tokens``: the mean of a request's natural answer length (module docstring,
        End of sequence); 0: every request runs to ``max_tokens``. ``tiers`` (the replica passes
        its request classes with ``replica.strict_tiers``): the engine serves its waiting queue by
        tier, then first-come-first-served (vLLM's priority scheduling), and a step in which the
        strictest tier has prefill runs no lower tier's prefill (``EngineConfig.strict_prefill_first``;
        module docstring). None: FCFS, as vLLM's default. ``long_prefill_token_threshold``: the
        most prompt tokens one request computes in a step, as vLLM's option of that name
        (``EngineConfig``); 0, its default: the step's budget."""
        if speed <= 0:
            raise ValueError("speed must be > 0")
        if pacing not in ("deadline", "sleep"):
            raise ValueError("pacing must be 'deadline' or 'sleep'")
        if max_catchup_s < 0:
            raise ValueError("max_catchup_s must be >= 0")
        if vocab_size <= 16:
            raise ValueError("vocab_size must be > 16")
        if isinstance(eos_mean_tokens, bool) or not isinstance(eos_mean_tokens, int) or eos_mean_tokens < 0:
            raise ValueError("eos_mean_tokens must be an integer >= 0 (0: no end of sequence)")
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.speed = speed
        self.time_scale = 1.0 / speed  # the gate's stall bound stretches with the slowed model
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_mean_tokens = eos_mean_tokens
        self.clock = clock or MonotonicClock()
        self.cost = CostModel.from_profile(profile)
        self.tiers = tiers if tiers is not None and tiers.classes else None
        if tiers is not None and self.tiers is None:
            raise ValueError("tiers needs at least one request class")
        cfg = EngineConfig(block_size, max_num_batched_tokens, max_num_seqs, kv_blocks,
                           host_kv_blocks=host_kv_blocks, host_link_bytes_per_s=host_link_bytes_per_s,
                           strict_prefill_first=self.tiers is not None,  # checked there
                           long_prefill_token_threshold=long_prefill_token_threshold)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        order = (make_policy("priority-fcfs", clock=self.clock, cost=self.cost, block_size=block_size,
                             classes=self.tiers) if self.tiers is not None
                 else make_policy("fcfs", clock=self.clock, cost=self.cost, block_size=block_size))
        self.model = EngineModel(cfg, self.cost, order, self.clock)
        self.model.listener = self
        self._live: dict[int, _Live] = {}
        self._next_rid = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failed: BaseException | None = None
        self._on_stored: Callable[[Iterable[int]], None] | None = None
        self._on_removed: Callable[[Iterable[int]], None] | None = None
        self._on_tier: Callable[[Sequence[tuple[bool, int]]], None] | None = None
        self.on_step: Callable[[], None] | None = None  # the gate's pump, after every step
        self.pacing = pacing
        self.max_catchup_s = max_catchup_s
        self._deadline: float | None = None  # wall (monotonic) end of the current busy run's last step
        self._busy_since: float | None = None
        self.modelled_busy_s = 0.0  # sum of modelled step times (wall seconds, after speed)
        self.wall_busy_s = 0.0  # wall time of busy runs (first step start -> last step end)
        self.written_off_s = 0.0  # lateness beyond max_catchup_s, never repaid
        self.late_s: deque[float] = deque(maxlen=20_000)  # per step: wall end - deadline
        self.aborted = 0  # requests whose consumer left before they finished
        self.slowdown = 1.0  # injected fault (replicas/faults.py): every step this many times longer
        self._running = asyncio.Event()  # cleared while an injected stall holds the loop
        self._running.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    @property
    def healthy(self) -> bool:
        return self._failed is None and self._task is not None and not self._task.done()

    def _idle(self) -> None:
        """A busy run ended: its wall time counts, and the next step starts a fresh deadline."""
        if self._busy_since is not None and self._deadline is not None:
            self.wall_busy_s += max(self._deadline, time.monotonic()) - self._busy_since
        self._busy_since = None
        self._deadline = None

    async def _pace(self, dt: float) -> None:
        """Sleep until this step's end (see the module docstring, "Pacing")."""
        now = time.monotonic()
        self.modelled_busy_s += dt
        if self._deadline is None:
            self._deadline = self._busy_since = now
        elif now - self._deadline > self.max_catchup_s:  # too far behind: write the excess off
            self.written_off_s += now - self._deadline - self.max_catchup_s
            self._deadline = now - self.max_catchup_s
        self._deadline += dt
        if self.pacing == "sleep":
            await asyncio.sleep(dt)
        else:
            await asyncio.sleep(max(0.0, self._deadline - time.monotonic()))
        end = time.monotonic()
        self.late_s.append(end - self._deadline)
        if self.pacing == "sleep":
            self._deadline = max(self._deadline, end)  # the plain loop never catches up

    def timing(self) -> dict[str, float | str]:
        """How the real-time loop kept up: modelled vs wall busy seconds (their ratio > 1 means
        steps ran long), per-step lateness percentiles (ms) and the written-off deficit."""
        late = np.asarray(self.late_s, dtype=float)
        wall = self.wall_busy_s
        if self._busy_since is not None:
            wall += time.monotonic() - self._busy_since
        q = np.percentile(late, [50, 90, 99]) * 1e3 if late.size else np.zeros(3)
        return {
            "pacing": self.pacing,
            "steps": float(self.model.steps),
            "modelled_busy_s": self.modelled_busy_s,
            "wall_busy_s": wall,
            "slowdown": wall / self.modelled_busy_s if self.modelled_busy_s else 1.0,
            "late_ms_p50": float(q[0]),
            "late_ms_p90": float(q[1]),
            "late_ms_p99": float(q[2]),
            "written_off_s": self.written_off_s,
        }

    async def _loop(self) -> None:
        try:
            while True:
                if not self.model.has_work():
                    self._idle()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if not self._running.is_set():  # an injected stall: no step until it is lifted
                    self._idle()
                    await self._running.wait()
                    continue
                dt = self.model.start_step()
                if dt is None:  # memory-bound with nothing runnable: wait for a change
                    self._idle()
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except TimeoutError:
                        pass
                    continue
                batch = [(r, r.generated) for r in self.model.scheduled]
                await self._pace(dt * self.slowdown / self.speed)
                self.model.finish_step()
                for r, before in batch:
                    self._emit(r, before)
                if self.on_step is not None:
                    self.on_step()
                # let the requests the gate just admitted reach the model before the next step
                # is scheduled (as in the simulator, where they join the very next step)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug in the model must fail requests, not hang them
            self._failed = e
            for live in self._live.values():
                live.out.put_nowait(EngineFailed(f"sim engine failed: {e!r}"))
            raise

    def _emit(self, r: EngineRequest, before: int) -> None:
        live = self._live.get(r.rid)
        if live is None or r.generated <= before:
            return
        done = r.finished_s >= 0
        if self.stream_interval_s > 0:
            now = self.clock.now()
            if live.cached_sent and not done and now < live.hold_until:
                return  # a later output within the stream interval: its tokens leave with a later step's
            live.hold_until = now + self.stream_interval_s
        new = live.output_ids[live.sent : r.generated]
        live.sent = r.generated
        cached = None
        if not live.cached_sent:
            cached = max(0, r.cached_tokens)
            live.cached_sent = True
        live.out.put_nowait(EngineOutput(new, finished=done, finish_reason=live.finish_reason if done else None,
                                         cached_tokens=cached))

    def set_fault(self, stall: bool = False, slowdown: float = 1.0) -> bool:
        """Injected faults (``replicas/faults.py``): ``stall`` stops the steps (the actor and
        its health check stay up); ``slowdown`` >= 1 stretches every step. Applied: True."""
        if slowdown < 1.0:
            raise ValueError("slowdown must be >= 1")
        self.slowdown = slowdown
        if stall:
            self._running.clear()
        else:
            self._running.set()
            self._wake.set()
        return True

    # -- EngineModel.listener (the KV events; the other callbacks are the base's no-ops) -------

    def on_kv_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        stored = [h for s, h in events if s]
        removed = [h for s, h in events if not s]
        if removed and self._on_removed is not None:
            self._on_removed(removed)
        if stored and self._on_stored is not None:
            self._on_stored(stored)

    def on_kv_tier_events(self, replica: int, events: Sequence[tuple[bool, int]]) -> None:
        """Host tier only (``host_kv_blocks`` > 0): which hashes became / stopped being
        host-only, right after the KV events of the same flush (``BlockPool.tier_events``)."""
        if self._on_tier is not None:
            self._on_tier(events)

    # -- Engine protocol ---------------------------------------------------------------------

    def _spec(self, call: GenerateCall, rid: int, output_ids: list[int]) -> RequestSpec:
        """The engine model's request: the ingress's prompt hashes, with the blocks that the
        prompt's partial tail and the output complete chained after them (the chain property:
        continuing from the last prompt hash equals hashing the whole sequence). O(tail + output)."""
        bs = self.block_size
        n_full = len(call.prompt_token_ids) // bs
        hashes = list(call.block_hashes[:n_full])
        parent = hashes[-1] if hashes else salt_seed(call.cache_salt)
        tail = HashState(bs, parent, np.empty(0, dtype=np.uint32), [])
        tail.extend(np.asarray(list(call.prompt_token_ids[n_full * bs :]) + output_ids, dtype=np.int64))
        return RequestSpec(
            rid=rid,
            arrival_s=self.clock.now(),
            prompt_tokens=len(call.prompt_token_ids),
            output_tokens=len(output_ids),
            block_hashes=tuple(hashes + tail.hashes),
            priority_class=self._class_of(call.priority_class),
        )

    def _class_of(self, name: str) -> str:
        """The request's class as the engine orders it: its configured class with ``tiers`` (the
        ingress and the gate have refused an unknown one already), else "". O(C)."""
        return self.tiers.resolve(name) if self.tiers is not None else ""

    async def generate(self, call: GenerateCall) -> AsyncIterator[EngineOutput]:
        if self._failed is not None:
            raise EngineFailed(f"sim engine failed: {self._failed!r}")
        check_sim_params(call)
        rid = self._next_rid
        self._next_rid += 1
        if call.seed is None:
            rng = np.random.default_rng([self.seed, rid])
        else:  # OpenAI's seed: the output is a function of the seed and the prompt
            prompt = np.asarray(call.prompt_token_ids, dtype=np.int64).tobytes()
            rng = np.random.default_rng([call.seed % 2**63, zlib.crc32(prompt), len(call.prompt_token_ids)])
        n, reason = call.max_tokens, "length"
        if self.eos_mean_tokens and not call.ignore_eos:
            # the length from a child stream, which leaves the ids' stream as it is: a seeded answer
            # is the same text up to where it stops, and only the tokens it keeps are drawn
            lengths = rng.spawn(1)[0]
            natural = int(lengths.geometric(1.0 / self.eos_mean_tokens))
            if natural < call.min_tokens:  # no end before min_tokens: the same stop chance from there on
                natural = call.min_tokens - 1 + int(lengths.geometric(1.0 / self.eos_mean_tokens))
            if natural < n:
                n, reason = natural, "stop"
        if call.allowed_token_ids is None:
            output_ids = rng.integers(16, self.vocab_size, size=n).tolist()
        else:  # vLLM's allowed_token_ids: samples from those alone
            output_ids = rng.choice(np.asarray(call.allowed_token_ids, dtype=np.int64), size=n).tolist()
        spec = self._spec(call, rid, output_ids)
        live = _Live(rid, output_ids, reason)
        self._live[rid] = live
        r = self.model.add(spec)
        if r.rejected:
            del self._live[rid]
            raise RequestTooLarge(f"request cannot fit this engine: {r.rejected}")
        self._wake.set()
        try:
            while True:
                item = await live.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._live.pop(rid, None)
            # the consumer left early (client disconnect, cancellation): free its slot and blocks
            if self.model.abort(rid):
                self.aborted += 1
                self._wake.set()

    def stats(self) -> EngineStats:
        m = self.model
        prefilling = 0
        pending = 0
        for r in m.reqs.values():  # waiting in the engine or running
            if r.generated == 0:
                prefilling += 1
                pending += max(0, r.spec.prompt_tokens - r.num_computed)
        pool = m.pool
        return EngineStats(
            running=len(m.reqs),
            prefilling=prefilling,
            pending_prefill_tokens=pending,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free,
        )

    def can_fit(self, prompt_tokens: int, block_hashes: Sequence[int]) -> bool:
        pool = self.model.pool
        n_cacheable = max(0, (prompt_tokens - 1) // self.block_size)
        hit = pool.longest_hit(block_hashes[:n_cacheable])
        need = -(-(prompt_tokens + 1) // self.block_size) - len(hit)
        return pool.free_after_touch(hit) >= need

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        return len(self.model.pool.longest_hit(block_hashes))

    def cached_hashes(self) -> list[int]:
        """Every block hash in the engine's prefix cache, in either tier (the KV events cover
        both). O(cached blocks)."""
        pool = self.model.pool
        return list(pool.cached) + pool.host_only()

    def set_cache_listener(
        self,
        on_stored: Callable[[Iterable[int]], None],
        on_removed: Callable[[Iterable[int]], None],
    ) -> None:
        self._on_stored = on_stored
        self._on_removed = on_removed

    def host_only_hashes(self) -> list[int]:
        """The hashes held in the host KV tier only (not on the GPU); [] without a host tier.
        O(host-tier blocks)."""
        return self.model.pool.host_only()

    def set_tier_listener(self, on_tier: Callable[[Sequence[tuple[bool, int]]], None] | None) -> None:
        """Receive the tier events (``(host_only, hash)``; only with a host tier)."""
        self._on_tier = on_tier

    @property
    def preemptions(self) -> int:
        return self.model.preemptions
