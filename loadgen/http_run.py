"""``loadgen run``: replay a workload against an OpenAI-compatible server and summarise it.

The workload is the simulator's (``make_workload`` with the same arguments ``sim.runner``
passes), so a live run and a simulated one offer the same requests:

- Open loop: spec ``i`` is sent at ``start + spec.arrival_s`` (never clipped or reordered; a
  late send is recorded in ``send_lag_s``).
- Closed loop (agentic sessions, ``--concurrency``): when a request ends (finished, rejected or
  timed out, as the simulator also completes rejected requests), ``workload.on_complete(spec,
  finish_s)`` gives its follow-ups, ``finish_s`` in seconds since the start, and each is sent at
  its own ``arrival_s``.
- As in the simulator, ``duration_s`` ends the workload's arrivals and started sessions (and
  fixed-concurrency runs) drain. ``max_requests`` caps what is sent and ``stop_after_s`` stops
  sending after that many seconds; in-flight requests are always awaited, each bounded by
  ``timeout_s``.
- Prompts are token ids from ``loadgen.prompts`` (shared block hashes -> shared prefixes); a
  session's next turn starts with the previous turn's real prompt + returned output ids.

- Hang-ups (``disconnect_fraction``): that fraction of requests, drawn with the run's seed, has
  its client go away on purpose, half of them after a random 0-``disconnect_within_s`` seconds
  (often while still queued), half after their first token event (mid-stream).
- Accounting (``loadgen/accounting.py``): every request sent gets exactly one outcome, and the
  summary's ``accounting`` counts them (completed, refused, failed, disconnected, lost).

The summary has every key of ``sim run --json`` (those only a simulator knows are null) plus
``HTTP_ONLY_KEYS``. Counts: ``n_requests`` (sent) = ``n_finished`` + ``n_rejected`` (non-2xx
answers) + ``n_unfinished`` (timeouts, connection errors, broken streams, hang-ups).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fairway.clock import Clock, MonotonicClock
from fairway.request import RequestSpec, Workload
from fairway.summary import RequestSample, pct, realized_rate, served_rate, summarize_samples
from loadgen.accounting import Ledger, classify
from loadgen.http_client import ServerError, StreamResult, first_model, reuse_tracing, stream_completion
from loadgen.progress import ProgressLine
from loadgen.prompts import DEFAULT_VOCAB_SIZE, PromptBuilder, SessionContexts
from workloads.class_mix import ClassMix, parse_class_values, parse_mix
from workloads.registry import make_workload_from

#: Keys ``loadgen run`` writes that ``sim run`` does not.
HTTP_ONLY_KEYS = frozenset(
    {"itl_s", "send_lag_s", "errors_by_status", "n_retries", "url", "model", "wall_s", "accounting"}
)

#: Keys of ``sim run`` that only a simulator knows: null over HTTP.
SIM_ONLY_KEYS = (
    "policy_options", "router", "routers", "profile", "kv_blocks", "preempted_requests", "preemptions",
    "evictions", "promotions", "guard_acts", "first_step_holds", "busy_fraction", "slots", "sim_end_s", "sim_wall_s",
    "ceiling_hit_ratio",
    "hit_bound_capacity", "hit_bound_infinite", "ttft_floor_s", "routing_reasons", "router_ttft_model", "router_view",
    "sync_delay_s",
)


class HttpRunConfig(BaseModel):
    """One load-generator run. Field bounds are checked at the boundary (CLI, tests)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="server base URL, e.g. http://127.0.0.1:8000")
    workload: str
    rate: float = Field(4.0, gt=0, description="requests/s (open loop) or sessions/s (agentic)")
    duration_s: float | None = Field(None, gt=0, description="arrivals stop after this (seconds); default: "
                                     "300 s for a synthetic workload, the whole trace for a replay")
    time_scale: float = Field(1.0, gt=0, description="trace time compression factor")
    concurrency: int | None = Field(None, ge=1, description="fixed-concurrency mode")
    seed: int = Field(0, ge=0)
    block_size: int = Field(16, ge=1, description="tokens per hashed block (the server's)")
    model: str | None = Field(None, description="model name; None asks GET /v1/models")
    vocab_size: int = Field(DEFAULT_VOCAB_SIZE, ge=32, description="token ids are < this")
    max_requests: int | None = Field(None, ge=1, description="send at most this many")
    stop_after_s: float | None = Field(None, gt=0, description="send nothing after this (s)")
    timeout_s: float = Field(600.0, gt=0, description="total time limit per request (s)")
    retries: int = Field(0, ge=0, description="retries of a 429/503 after its Retry-After")
    connect_timeout_s: float = Field(10.0, gt=0, description="limit of the GET /v1/models probe")
    disconnect_fraction: float = Field(0.0, ge=0, le=1, description="share of clients that hang up on purpose")
    disconnect_within_s: float = Field(0.5, gt=0, description="a timed hang-up comes within this (s)")
    api_key: str | None = Field(None, description="sent as 'Authorization: Bearer <key>'", repr=False)
    class_mix: str = Field("", description="name=share,...: each request's class (the body's priority), drawn "
                           "by a seeded RNG as the simulator's --class-mix; the summary is then also by class")
    class_objectives: str = Field("", description="name=seconds,...: each class's TTFT objective, for the "
                                  "summary's attainment by class")

    @model_validator(mode="after")
    def _check_classes(self) -> HttpRunConfig:
        """The class mix and objectives parse (checked here, at the edge, not at the summary)."""
        if self.class_mix:
            parse_mix(self.class_mix)
        parse_objectives(self.class_objectives)
        return self


def build_workload(cfg: HttpRunConfig) -> Workload:
    """The workload exactly as ``sim.runner.build`` makes it (with its class mix, as the
    simulator's). Raises ``WorkloadError``, or ``ValueError`` for a bad mix."""
    workload = make_workload_from(cfg)
    return ClassMix(workload, parse_mix(cfg.class_mix), cfg.seed) if cfg.class_mix else workload


def parse_objectives(text: str) -> dict[str, float]:
    """``interactive=1,batch=30`` -> {name: seconds}; each > 0 (``ValueError`` naming the entry)."""
    return dict(parse_class_values(text, "objective", "seconds"))


@dataclass(slots=True)
class RequestRecord:
    """One sent request: what the workload asked, when it went out, what came back.
    ``sent_s`` and ``finish_s`` are seconds since the run's start; ``reused_context`` says
    the prompt began with the session's previous prompt + returned output ids. ``result.output_ids``
    is cleared once handed to the session contexts (a long run keeps no per-token lists)."""

    rid: int
    kind: str
    session: int
    turn: int
    arrival_s: float
    sent_s: float
    finish_s: float
    spec_prompt_tokens: int
    reused_context: bool
    result: StreamResult
    klass: str = ""


class HttpLoadRun:
    """Drive ``workload`` against ``cfg.url``; ``await run()`` returns the JSON summary.

    ``clock`` must be monotonic wall time (sleeps are real); ``progress`` is where the progress
    line goes (None: nowhere). Not reusable: one instance, one run.
    """

    def __init__(
        self,
        cfg: HttpRunConfig,
        workload: Workload | None = None,
        *,
        clock: Clock | None = None,
        progress: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        self.workload = workload if workload is not None else build_workload(cfg)
        self.clock = clock or MonotonicClock()
        self.prompts = PromptBuilder(vocab_size=cfg.vocab_size, block_size=cfg.block_size)
        self.contexts = SessionContexts()
        self.progress = ProgressLine(self.clock, progress, total=cfg.max_requests)
        self.records: list[RequestRecord] = []
        self.model: str | None = cfg.model
        self.n_issued = 0
        self.ledger = Ledger()
        self._hang_rng = np.random.default_rng([cfg.seed, 0x4A6])  # who hangs up, and when
        self._start = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._http: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------------------ driving

    def _elapsed(self) -> float:
        return self.clock.now() - self._start

    def _may_issue(self) -> bool:
        cfg = self.cfg
        if cfg.max_requests is not None and self.n_issued >= cfg.max_requests:
            return False
        return cfg.stop_after_s is None or self._elapsed() < cfg.stop_after_s

    async def _sleep_until(self, at_s: float) -> None:
        dt = at_s - self._elapsed()
        if dt > 0:
            await asyncio.sleep(dt)

    def _launch(self, spec: RequestSpec) -> None:
        task = asyncio.get_running_loop().create_task(self._one(spec))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def payload(self, spec: RequestSpec, ids: np.ndarray) -> dict[str, Any]:
        """The request body for ``spec`` (see the module docstring of ``http_client``)."""
        return {
            "model": self.model,
            "prompt": ids.tolist(),
            "max_tokens": spec.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
            "temperature": 0,
            **({"priority": spec.priority_class} if spec.priority_class else {}),
        }

    async def _one(self, spec: RequestSpec) -> None:
        await self._sleep_until(spec.arrival_s)
        if not self._may_issue():
            return
        self.n_issued += 1
        prefix = self.contexts.prefix_for(spec)
        ids = self.prompts.token_ids(spec, prefix)
        body = self.payload(spec, ids)
        sent_s = self._elapsed()
        self.progress.on_sent()
        assert self._http is not None
        key = self.n_issued
        self.ledger.send(key)
        after_s, after_events = self._hang_up(spec)
        res = await stream_completion(
            self._http, self.cfg.url, body, clock=self.clock, timeout_s=self.cfg.timeout_s,
            retries=self.cfg.retries, hang_up_after_s=after_s, hang_up_after_events=after_events,
        )
        self.ledger.record(key, classify(res))
        finish_s = max(self._elapsed(), spec.arrival_s)
        self.records.append(RequestRecord(
            rid=spec.rid, kind=spec.kind, session=spec.session, turn=spec.turn, arrival_s=spec.arrival_s,
            sent_s=sent_s, finish_s=finish_s, spec_prompt_tokens=spec.prompt_tokens,
            reused_context=prefix is not None, result=res, klass=spec.priority_class,
        ))
        self.progress.on_done(res.ok)
        if res.ok and res.output_ids is not None:
            self.contexts.remember(spec, ids, np.asarray(res.output_ids, dtype=np.int64))
        res.output_ids = None  # handed on; a long run keeps no per-token lists
        if self.workload.closed_loop:
            for follow in self.workload.on_complete(spec, finish_s):
                self._launch(follow)

    def _hang_up(self, spec: RequestSpec) -> tuple[float | None, int | None]:
        """Whether ``spec``'s client hangs up on purpose, and when (the module docstring):
        (seconds, None), (None, token events) or (None, None); drawn in issue order, whatever
        the request. O(1)."""
        f = self.cfg.disconnect_fraction
        if f <= 0.0 or self._hang_rng.random() >= f:
            return None, None
        if self._hang_rng.random() < 0.5:
            return float(self._hang_rng.uniform(0.0, self.cfg.disconnect_within_s)), None
        return None, 1

    async def run(self) -> dict[str, Any]:
        """Send the workload, wait for every request, return the summary. Raises
        ``ServerError`` if the server cannot be reached (before anything is sent)."""
        connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on open connections
        timeout = aiohttp.ClientTimeout(total=None)  # each request is bounded by timeout_s instead
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                         trace_configs=[reuse_tracing()]) as http:
            self._http = http
            listed = await first_model(http, self.cfg.url, timeout_s=self.cfg.connect_timeout_s)
            if self.model is None:
                if listed is None:
                    raise ServerError(f"{self.cfg.url}/v1/models lists no model; pass --model")
                self.model = listed
            self._start = self.clock.now()
            self.progress.start()
            try:
                for spec in self.workload.initial():
                    await self._sleep_until(spec.arrival_s)
                    self._check()
                    if not self._may_issue():
                        break
                    self._launch(spec)
                while self._tasks:
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_EXCEPTION)
                    self._check()
            finally:
                for task in list(self._tasks):
                    task.cancel()
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                self.progress.close()
            wall_s = self._elapsed()
        return self.summary(wall_s)

    # ------------------------------------------------------------------------------ summary

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The JSON-ready summary (module docstring) of ``self.records``."""
        cfg = self.cfg
        done = [r for r in self.records if r.result.ok]
        samples = [_sample(r) for r in done]
        rejected = sum(1 for r in self.records if not r.result.ok and r.result.rejected)
        errors = Counter(r.result.status for r in self.records if not r.result.ok)
        replicas: dict[str, list[int]] = {}
        for r, s in zip(done, samples, strict=True):
            if r.result.replica:
                acc = replicas.setdefault(r.result.replica, [0, 0, 0])
                acc[0] += 1
                acc[1] += s.prompt_tokens
                acc[2] += s.cached_tokens
        policy = next((r.result.policy for r in done if r.result.policy), None)
        out: dict[str, Any] = {
            "workload": cfg.workload,
            "policy": policy,
            "replicas": len(replicas) or None,
            "rate_rps": cfg.rate,
            "realized_rate_rps": realized_rate([r.sent_s for r in done]),
            "served_rps": served_rate([r.sent_s for r in done], [r.finish_s for r in done]),
            "concurrency": cfg.concurrency,
            "seed": cfg.seed,
            "n_requests": len(self.records),
            "n_finished": len(done),
            "n_rejected": rejected,
            "n_unfinished": len(self.records) - len(done) - rejected,
            **summarize_samples(samples),
            **dict.fromkeys(SIM_ONLY_KEYS),  # what only a simulator knows: null over HTTP
            "per_replica": [
                {"replica": name, "requests": n, "hit_ratio": c / p if p else 0.0,
                 "busy_fraction": None, "prefill_busy_fraction": None}
                for name, (n, p, c) in sorted(replicas.items())
            ],
            "itl_s": pct(np.concatenate([np.asarray(r.result.itl_s, dtype=float) for r in done] or [np.empty(0)])),
            "send_lag_s": pct([r.sent_s - r.arrival_s for r in self.records]),
            "errors_by_status": dict(sorted(errors.items())),
            "n_retries": sum(r.result.retries for r in self.records),
            "url": cfg.url,
            "model": self.model,
            "wall_s": wall_s,
            "accounting": self.ledger.report(),
        }
        if cfg.class_mix:
            out["by_class"] = self._by_class()
        return out

    def _by_class(self) -> dict[str, dict[str, Any]]:
        """Per class: requests sent, answered, refused; TTFT and gate-wait percentiles of the answered ones and,
        with an objective, the share of the sent ones whose first token met it (a refused or
        unanswered request misses it: attainment, as the simulator counts it)."""
        objectives = parse_objectives(self.cfg.class_objectives)
        out: dict[str, dict[str, Any]] = {}
        for name in sorted({r.klass for r in self.records}):
            rs = [r for r in self.records if r.klass == name]
            ok = [_sample(r) for r in rs if r.result.ok]
            ttft = [s.ttft_s for s in ok]
            row: dict[str, Any] = {"n": len(rs), "n_finished": len(ttft),
                                   "n_rejected": sum(1 for r in rs if not r.result.ok and r.result.rejected),
                                   "ttft_s": pct(ttft),
                                   "queue_wait_s": pct([s.queue_wait_s for s in ok if s.queue_wait_s is not None])}
            if name in objectives:
                row["objective_s"] = objectives[name]
                row["n_met"] = sum(1 for t in ttft if t <= objectives[name])
                row["attainment"] = row["n_met"] / len(rs) if rs else None
            out[name] = row
        return out


def _sample(r: RequestRecord) -> RequestSample:
    res = r.result
    prompt = res.prompt_tokens if res.prompt_tokens is not None else r.spec_prompt_tokens
    cached = min(max(0, res.cached_tokens or 0), prompt)
    ttft = res.ttft_s if res.ttft_s is not None else (res.e2e_s or 0.0)  # no token at all: the whole wait
    return RequestSample(ttft_s=ttft, queue_wait_s=res.queue_wait_s, lane=res.lane, prompt_tokens=prompt,
                         cached_tokens=cached, work=float(prompt - cached), e2e_s=res.e2e_s,
                         output_tokens=res.completion_tokens or 0)

