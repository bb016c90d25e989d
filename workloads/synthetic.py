"""Synthetic workloads: RAG and mixed (open loop), agentic sessions (closed loop).

Common rules:
- Everything random derives from the injected ``numpy.random.Generator``. At construction each
  workload draws three independent seeds from it: arrivals, shared content (corpus, prefixes,
  preamble) and per-request draws. So the corpus does not change with ``rate`` or bursts, and
  ``initial()`` can be called again and yields identical specs.
- ``block_hashes`` chain over the prompt token ids followed by the output token ids (full blocks
  only), via ``fairway.hashing.HashState``; shared segments are hashed once (``SegmentMemo``).
- rids are 0, 1, 2, ... in arrival order (open loop) or in creation order (closed loop).
- ``kind`` labels the request class; see each class.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fairway.hashing import DEFAULT_BLOCK_SIZE, HashState
from fairway.request import RequestSpec, Workload, WorkloadError
from workloads.arrivals import BurstSchedule, bursty_arrivals, poisson_arrivals
from workloads.content import (
    LogNormalLen,
    SegmentMemo,
    UniformLen,
    ZipfChoice,
    extend_request,
    random_tokens,
    segment_rng,
)


def _seeds(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 2**63 - 1, size=n)]


class _OpenLoop(Workload):
    """Shared machinery of the open-loop synthetic workloads: arrivals fixed at construction,
    request content built lazily in ``initial()`` from a re-created generator."""

    closed_loop = False

    def __init__(
        self,
        rng: np.random.Generator,
        *,
        rate: float,
        duration_s: float,
        block_size: int,
        keep_tokens: bool,
        bursts: BurstSchedule | None,
    ) -> None:
        if block_size < 1:
            raise WorkloadError(f"block_size must be >= 1, got {block_size}")
        arrival_seed, self._content_seed, self._draw_seed = _seeds(rng, 3)
        arr_rng = np.random.default_rng(arrival_seed)
        if bursts is None:
            self.arrivals = poisson_arrivals(arr_rng, rate, duration_s)
        else:
            self.arrivals = bursty_arrivals(arr_rng, rate, duration_s, bursts)
        self.rate = rate
        self.duration_s = duration_s
        self.bursts = bursts
        self.block_size = block_size
        self.keep_tokens = keep_tokens

    def __len__(self) -> int:
        return int(self.arrivals.size)


# --------------------------------------------------------------------------------------- RAG


@dataclass(frozen=True, slots=True)
class RagParams:
    """RAG request shape: ``system prompt + one document + unique question``.

    - ``system_tokens``: the instructions every request shares.
    - ``n_docs`` / ``zipf_s``: corpus size and popularity skew. 2,000 documents of ~3.4k
      tokens are ~7M tokens, ~8x the ~0.8M-token KV cache of an H200 serving Llama-3.1-8B, so
      the cache can hold the popular head but not the corpus: reuse is graded, not all-or-none.
      s = 1.1 is in the range measured for document and web popularity (0.8-1.2).
    - ``doc_len``: log-normal, median 2,500 tokens; a cold document leaves thousands of tokens.
    - ``question_len``: a few dozen tokens; a cached document leaves only this (plus the
      partial block it starts in), so uncached work spreads ~100x between hit and miss.
    - ``output_len``: modest answers, median 128 tokens.
    """

    system_tokens: int = 1_000
    n_docs: int = 2_000
    zipf_s: float = 1.1
    doc_len: LogNormalLen = LogNormalLen(2_500, 0.8, 200, 16_000)
    question_len: UniformLen = UniformLen(16, 64)
    output_len: LogNormalLen = LogNormalLen(128, 0.6, 8, 1_024)


class RagWorkload(_OpenLoop):
    """Open-loop RAG. ``rate`` = requests/s (base rate when ``bursts`` is set).

    Kinds: ``doc-hit`` when the document was requested earlier in this workload (a hit under a
    perfect cache), ``doc-cold`` for its first request.
    """

    name = "rag"

    def __init__(
        self,
        rng: np.random.Generator,
        *,
        rate: float,
        duration_s: float,
        block_size: int = DEFAULT_BLOCK_SIZE,
        keep_tokens: bool = False,
        bursts: BurstSchedule | None = None,
        params: RagParams | None = None,
    ) -> None:
        super().__init__(
            rng,
            rate=rate,
            duration_s=duration_s,
            block_size=block_size,
            keep_tokens=keep_tokens,
            bursts=bursts,
        )
        self.params = p = params or RagParams()
        self._zipf = ZipfChoice(p.n_docs, p.zipf_s)
        self.doc_lengths = p.doc_len.sample(segment_rng(self._content_seed, 0), p.n_docs)
        self._memo = SegmentMemo(block_size, self._segment_tokens, keep_tokens)

    def _segment_tokens(self, key: object) -> np.ndarray:
        if key == "sys":
            return random_tokens(segment_rng(self._content_seed, 1), self.params.system_tokens)
        _, doc = key  # ("doc", k)
        return random_tokens(segment_rng(self._content_seed, 2, doc), self.doc_lengths[doc])

    def initial(self) -> Iterator[RequestSpec]:
        p = self.params
        rng = np.random.default_rng(self._draw_seed)
        n = len(self)
        docs = self._zipf.sample(rng, n)
        q_lens = p.question_len.sample(rng, n)
        out_lens = p.output_len.sample(rng, n)
        seen: set[int] = set()
        for i in range(n):
            doc = int(docs[i])
            prefix, prefix_tokens = self._memo.get(("sys", ("doc", doc)))
            question = random_tokens(rng, q_lens[i])
            output = random_tokens(rng, out_lens[i])
            hashes, tokens = extend_request(
                prefix, prefix_tokens, question, output, self.keep_tokens
            )
            kind = "doc-hit" if doc in seen else "doc-cold"
            seen.add(doc)
            yield RequestSpec(
                rid=i,
                arrival_s=float(self.arrivals[i]),
                prompt_tokens=prefix.n_tokens + int(q_lens[i]),
                output_tokens=int(out_lens[i]),
                block_hashes=hashes,
                kind=kind,
                tokens=tokens,
            )


# ------------------------------------------------------------------------------------- mixed


@dataclass(frozen=True, slots=True)
class MixedParams:
    """Mixed cheap-reuse and expensive-cold requests.

    - ``cheap_fraction`` 0.8: by count most requests are cheap, but by prefill work the cold
      20% dominate (~0.2 * 5,500 vs ~0.8 * 50 uncached tokens per request), the regime where
      reuse-first ordering can starve cold work.
    - cheap: one of ``n_prefixes`` long shared prefixes (app system prompts with few-shot
      examples; uniform choice, all stay hot) plus a unique ``suffix_len`` suffix.
    - cold: a fully unique prompt of ``cold_len`` tokens.
    - Both classes have the same median prompt length (4,000), so prompt length alone does not
      tell cheap from expensive: only the cache does. Uncached work spreads ~100x.
    - ``output_len`` is the same for both classes, so only prefill differs.
    """

    cheap_fraction: float = 0.8
    n_prefixes: int = 8
    prefix_len: LogNormalLen = LogNormalLen(4_000, 0.3, 1_000, 12_000)
    suffix_len: UniformLen = UniformLen(16, 64)
    cold_len: LogNormalLen = LogNormalLen(4_000, 0.8, 512, 32_000)
    output_len: LogNormalLen = LogNormalLen(128, 0.6, 8, 1_024)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cheap_fraction <= 1.0:
            raise WorkloadError(f"cheap_fraction must be in [0, 1], got {self.cheap_fraction}")


class MixedWorkload(_OpenLoop):
    """Open-loop mix of ``cheap`` (shared prefix + short suffix) and ``cold`` (unique) requests.
    ``rate`` = requests/s (base rate when ``bursts`` is set)."""

    name = "mixed"

    def __init__(
        self,
        rng: np.random.Generator,
        *,
        rate: float,
        duration_s: float,
        block_size: int = DEFAULT_BLOCK_SIZE,
        keep_tokens: bool = False,
        bursts: BurstSchedule | None = None,
        params: MixedParams | None = None,
    ) -> None:
        super().__init__(
            rng,
            rate=rate,
            duration_s=duration_s,
            block_size=block_size,
            keep_tokens=keep_tokens,
            bursts=bursts,
        )
        self.params = p = params or MixedParams()
        self.prefix_lengths = p.prefix_len.sample(segment_rng(self._content_seed, 0), p.n_prefixes)
        self._memo = SegmentMemo(block_size, self._segment_tokens, keep_tokens)

    def _segment_tokens(self, key: object) -> np.ndarray:
        k = int(key)  # type: ignore[call-overload]
        return random_tokens(segment_rng(self._content_seed, 1, k), self.prefix_lengths[k])

    def initial(self) -> Iterator[RequestSpec]:
        p = self.params
        rng = np.random.default_rng(self._draw_seed)
        n = len(self)
        cheap = rng.random(n) < p.cheap_fraction
        prefix_ids = rng.integers(0, p.n_prefixes, size=n)
        suffix_lens = p.suffix_len.sample(rng, n)
        cold_lens = p.cold_len.sample(rng, n)
        out_lens = p.output_len.sample(rng, n)
        empty = self._memo.get(())
        for i in range(n):
            if cheap[i]:
                prefix, prefix_tokens = self._memo.get((int(prefix_ids[i]),))
                unique_len = int(suffix_lens[i])
            else:
                prefix, prefix_tokens = empty
                unique_len = int(cold_lens[i])
            unique = random_tokens(rng, unique_len)
            output = random_tokens(rng, out_lens[i])
            hashes, tokens = extend_request(prefix, prefix_tokens, unique, output, self.keep_tokens)
            yield RequestSpec(
                rid=i,
                arrival_s=float(self.arrivals[i]),
                prompt_tokens=prefix.n_tokens + unique_len,
                output_tokens=int(out_lens[i]),
                block_hashes=hashes,
                kind="cheap" if cheap[i] else "cold",
                tokens=tokens,
            )


# ----------------------------------------------------------------------------------- agentic


@dataclass(frozen=True, slots=True)
class AgenticParams:
    """Agent sessions: a shared tool preamble, then turns that each append a tool's output.

    - ``preamble_tokens`` 3,000: system prompt plus tool schemas, shared by every session.
    - ``task_len``: the user's task, unique per session (median 300 tokens).
    - ``tool_output_len``: what each tool call returns (a grep or a whole file): heavy-tailed,
      median 800, mean ~1,300 tokens. This is nearly all of a follow-up turn's uncached work.
    - ``output_len``: the model's reasoning plus tool call per turn, median 150 tokens.
    - turns per session: ``min(Geometric(1 / mean_turns), max_turns)``, mean ~14, at most 40;
      a session also ends when its context would pass ``max_context_tokens`` (Llama 3.1's
      window is 128k). Requests average ~21k prompt tokens, so ~40 concurrent sessions fill
      the ~0.8M-token KV cache of an H200 serving Llama-3.1-8B: memory-bound.
    - ``think_mean_s`` 2 s, exponential: the tool's run time between a response and the next
      turn. Short enough that a session's blocks are usually still cached when it returns.
    """

    preamble_tokens: int = 3_000
    task_len: LogNormalLen = LogNormalLen(300, 0.8, 16, 4_000)
    tool_output_len: LogNormalLen = LogNormalLen(800, 1.0, 16, 16_000)
    output_len: LogNormalLen = LogNormalLen(150, 0.7, 8, 2_048)
    mean_turns: float = 15.0
    max_turns: int = 40
    max_context_tokens: int = 120_000
    think_mean_s: float = 2.0

    def __post_init__(self) -> None:
        if not (self.mean_turns >= 1 and self.max_turns >= 1 and self.think_mean_s >= 0):
            raise WorkloadError(f"bad agentic parameters {self!r}")


@dataclass(frozen=True, slots=True)
class Swarm:
    """``size`` sessions that all start at ``at_s`` (default: a third into the run, once base
    sessions are in steady state, leaving two thirds to watch the recovery). 100 matches the
    concurrency of SGLang's published LPM-starvation numbers."""

    size: int = 100
    at_s: float | None = None

    def __post_init__(self) -> None:
        if self.size < 0 or (self.at_s is not None and not self.at_s >= 0):
            raise WorkloadError(f"bad swarm {self!r}")


@dataclass(slots=True)
class _Session:
    sid: int
    rng: np.random.Generator
    turns_total: int
    swarm: bool
    turn: int = 0
    rid: int = -1
    state: HashState | None = None  # full context (prompt + output of the outstanding turn)
    tokens: np.ndarray | None = field(default=None, repr=False)  # same, if tokens are kept


class AgenticWorkload(Workload):
    """Closed-loop agent sessions. ``rate`` = new sessions/s, Poisson, until ``duration_s``.

    Turn 0's prompt is ``preamble + task``. Turn k+1's prompt is turn k's whole sequence
    (prompt + output) plus a new tool output, and it is emitted by ``on_complete`` with
    ``arrival = finish + Exponential(think_mean_s)``. Its ``block_hashes`` therefore start with
    exactly turn k's ``block_hashes``. Sessions are bounded, so once arrivals stop, completing
    every request drains the workload.

    Each session draws from its own generator (seeded at construction), so a session's content
    does not depend on the order in which the host completes requests; only rids (assigned in
    creation order: first turns 0..S-1 from ``initial()``, then follow-ups) and arrival times
    do. Kinds: ``agent-start`` / ``agent-turn``, and ``swarm-start`` / ``swarm-turn`` for swarm
    sessions.
    """

    name = "agentic"
    closed_loop = True

    def __init__(
        self,
        rng: np.random.Generator,
        *,
        rate: float,
        duration_s: float,
        block_size: int = DEFAULT_BLOCK_SIZE,
        keep_tokens: bool = False,
        swarm: Swarm | None = None,
        params: AgenticParams | None = None,
    ) -> None:
        if block_size < 1:
            raise WorkloadError(f"block_size must be >= 1, got {block_size}")
        arrival_seed, self._content_seed, session_seed = _seeds(rng, 3)
        base = poisson_arrivals(np.random.default_rng(arrival_seed), rate, duration_s)
        is_swarm = np.zeros(base.size, dtype=bool)
        if swarm is not None and swarm.size > 0:
            at = duration_s / 3 if swarm.at_s is None else swarm.at_s
            times = np.concatenate([base, np.full(swarm.size, float(at))])
            is_swarm = np.concatenate([is_swarm, np.ones(swarm.size, dtype=bool)])
            order = np.argsort(times, kind="stable")
            base, is_swarm = times[order], is_swarm[order]
        self.session_arrivals = base
        self._session_is_swarm = is_swarm
        self._session_seeds = np.random.default_rng(session_seed).integers(
            0, 2**63 - 1, size=base.size
        )
        self.rate = rate
        self.duration_s = duration_s
        self.swarm = swarm
        self.block_size = block_size
        self.keep_tokens = keep_tokens
        self.params = params or AgenticParams()
        self._memo = SegmentMemo(block_size, self._segment_tokens, keep_tokens)
        self._sessions: dict[int, _Session] = {}
        self._next_rid = 0

    def _segment_tokens(self, key: object) -> np.ndarray:
        return random_tokens(segment_rng(self._content_seed, 1), self.params.preamble_tokens)

    @property
    def n_sessions(self) -> int:
        return int(self.session_arrivals.size)

    @property
    def open_sessions(self) -> int:
        """Sessions with a turn still to complete."""
        return len(self._sessions)

    def _spec(
        self,
        s: _Session,
        arrival: float,
        prompt_tokens: int,
        out_len: int,
        prompt_ids: np.ndarray | None,
    ) -> RequestSpec:
        assert s.state is not None
        s.rid = self._next_rid
        self._next_rid += 1
        prefix = "swarm" if s.swarm else "agent"
        return RequestSpec(
            rid=s.rid,
            arrival_s=arrival,
            prompt_tokens=prompt_tokens,
            output_tokens=out_len,
            block_hashes=tuple(s.state.hashes),
            session=s.sid,
            turn=s.turn,
            kind=f"{prefix}-start" if s.turn == 0 else f"{prefix}-turn",
            tokens=prompt_ids,
        )

    def initial(self) -> Iterator[RequestSpec]:
        """First turns of all sessions, in arrival order; resets any previous run's state."""
        p = self.params
        self._sessions = {}
        self._next_rid = 0
        preamble, preamble_tokens = self._memo.get(("preamble",))
        first: list[RequestSpec] = []
        for sid in range(self.n_sessions):
            rng = np.random.default_rng(int(self._session_seeds[sid]))
            turns = min(int(rng.geometric(1.0 / p.mean_turns)), p.max_turns)
            s = _Session(sid, rng, turns, bool(self._session_is_swarm[sid]))
            task = random_tokens(rng, p.task_len.one(rng))
            output = random_tokens(rng, p.output_len.one(rng))
            s.state = preamble.copy()
            s.state.extend(task)
            prompt_tokens = s.state.n_tokens
            s.state.extend(output)
            prompt_ids = None
            if self.keep_tokens:
                assert preamble_tokens is not None
                prompt_ids = np.concatenate([preamble_tokens, task])
                s.tokens = np.concatenate([prompt_ids, output])
            self._sessions[sid] = s
            first.append(
                self._spec(
                    s, float(self.session_arrivals[sid]), prompt_tokens, output.size, prompt_ids
                )
            )
        return iter(first)

    def on_complete(self, spec: RequestSpec, finish_s: float) -> list[RequestSpec]:
        """The session's next turn, or nothing when the session is over. O(context blocks)."""
        s = self._sessions.get(spec.session)
        if s is None or s.rid != spec.rid:
            raise WorkloadError(
                f"on_complete for rid {spec.rid} (session {spec.session}): not an outstanding "
                "request of this workload"
            )
        if finish_s < spec.arrival_s:
            raise WorkloadError(f"rid {spec.rid} finished at {finish_s} before its arrival")
        p = self.params
        assert s.state is not None
        if s.turn + 1 >= s.turns_total:
            del self._sessions[s.sid]
            return []
        tool = random_tokens(s.rng, p.tool_output_len.one(s.rng))
        output = random_tokens(s.rng, p.output_len.one(s.rng))
        think = float(s.rng.exponential(p.think_mean_s)) if p.think_mean_s > 0 else 0.0
        if s.state.n_tokens + tool.size + output.size > p.max_context_tokens:
            del self._sessions[s.sid]
            return []
        s.turn += 1
        s.state.extend(tool)
        prompt_tokens = s.state.n_tokens
        s.state.extend(output)
        prompt_ids = None
        if self.keep_tokens:
            assert s.tokens is not None
            prompt_ids = np.concatenate([s.tokens, tool])
            s.tokens = np.concatenate([prompt_ids, output])
        return [self._spec(s, finish_s + think, prompt_tokens, output.size, prompt_ids)]


def mean_session_turns(params: AgenticParams) -> float:
    """Expected turns per session ignoring the context cap: E[min(Geometric(p), max_turns)]."""
    q = 1.0 - 1.0 / params.mean_turns
    return (1.0 - q**params.max_turns) / (1.0 - q) if q > 0 else 1.0


__all__ = [
    "AgenticParams",
    "AgenticWorkload",
    "MixedParams",
    "MixedWorkload",
    "RagParams",
    "RagWorkload",
    "Swarm",
    "mean_session_turns",
]
