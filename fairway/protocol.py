"""What crosses the ingress -> replica boundary, and what an engine promises the gate.

The ingress tokenizes and hashes once; a ``GenerateCall`` carries the token ids and the chained
block hashes to the replica (through the Ray Serve handle, where the request router also reads
the hashes to estimate each replica's hit). The replica streams ``TokenChunk``s back. Errors the
client must see as HTTP statuses cross as the exception types below, so the ingress can map them
without parsing messages.

Every type here is a plain dataclass: cheap to pickle through Ray, no framework imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class GenerateCall:
    """One generation request as the replica receives it.

    Invariants: ``len(block_hashes) == len(prompt_token_ids) // block_size`` (full prompt blocks
    only, chained, tenant-salted as ``fairway/hashing.py`` computes them); ``max_tokens >= 1``.
    ``arrival_s`` is the wall-clock time (``time.time()``) the ingress sent it, after validation
    and tokenization, so a replica's TTFT counts the routing hop too; ``received_s`` is when the
    ingress had the request's headers (0 when unknown: then ``arrival_s``), where the client's wait
    starts.
    """

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    min_tokens: int = 0  # vLLM's: no end of sequence (nor stop token) before this many output tokens
    stop_token_ids: tuple[int, ...] = ()  # the answer ends at these (the ingress cuts there; vLLM stops too)
    cache_salt: str | None = None  # tenant salt folded into the first block's hash
    tenant: str = ""  # who sent it ("" without API keys): the gate shares its queue between tenants
    priority_class: str = ""  # flow-control class (fairway/policies/classes.py); "" = the default class
    session: str = ""  # the client's session key ("" for none): session-affinity routers key on it
    received_s: float = 0.0  # wall time the ingress had the headers (0: unknown, take arrival_s)
    avoid: tuple[str, ...] = ()  # replicas (Serve ids) that refused it: routed elsewhere while one has room
    ack: bool = False  # the gate yields an ``accepted`` chunk once it has queued it (the router's held queue)
    # Set by the ingress's request router when it routes the call, read back by the ingress: the
    # router's expected seconds from routing to the first token on the replica it was sent to (0:
    # the router predicts none) and its reason for the choice
    expected_ttft_s: float = 0.0
    routing_reason: str = ""
    # Sampling beyond temperature (OpenAI's names); an engine honours each or raises
    # ``UnsupportedParameter`` naming it. Defaults are the no-op values.
    seed: int | None = None  # same seed + prompt + parameters -> same output
    top_p: float = 1.0
    top_k: int = 0  # vLLM's: the k most likely tokens only (0 or -1: all)
    min_p: float = 0.0  # vLLM's: no token less likely than min_p x the most likely one (0: none)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only these (None: any)
    bad_words: tuple[str, ...] = ()  # vLLM's: words never generated (the engine tokenizes them)
    # The output constrained to JSON, in vLLM's ``StructuredOutputsParams`` names: {"json_object":
    # True}, or {"json": <JSON schema>} (OpenAI's response_format); None for free text
    structured_output: dict[str, Any] | None = None
    # The request parameter it came from: "response_format", or "tool_choice" (a forced tool
    # call's JSON); an engine's refusal names it
    structured_output_param: str = "response_format"
    # Each output token's log probability and this many top alternatives (OpenAI's logprobs /
    # top_logprobs); None: none
    logprobs: int | None = None
    # The prompt tokens' log probabilities too, with this many alternatives (a completion's echo
    # with logprobs: scoring a text); None: none. The engine then computes the whole prompt
    prompt_logprobs: int | None = None
    # The ingress replica whose stream channel may carry this call's middle chunks (its Serve
    # id; "" for none: every chunk on the call). ``replicas/channel.py``
    channel: str = ""

    @property
    def waited_from(self) -> float:
        """Where the client's wait starts, as well as the ingress knows it: ``received_s``, else
        ``arrival_s``."""
        return self.received_s or self.arrival_s


@dataclass(slots=True)
class TokenChunk:
    """New output tokens of one request; the last chunk has ``finished`` set.

    ``cached_tokens`` (the prompt tokens served from the prefix cache), ``lane`` and the timings
    are filled on the first chunk and repeated on the last, so a non-streaming caller reading only
    the last chunk sees them.
    """

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    lane: str = ""
    promoted: bool = False  # it reached the Fair lane while waiting (whichever lane admitted it)
    queue_wait_s: float = 0.0  # gate arrival -> admission into the engine
    ttft_s: float = 0.0  # ingress arrival -> first token, measured at the replica
    replica: str = ""
    accepted: bool = False  # no tokens: the gate has queued the request (asked for by ``GenerateCall.ack``)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the call asked for them
    # the prompt's, on the first output, when the call asked: None for its first token, which has no context
    prompt_logprobs: list[PromptLogprob | None] | None = None
    offset: int = 0  # output tokens before this chunk's (a stream channel's chunks and the call's interleave)


@dataclass(frozen=True, slots=True)
class ChannelCall:
    """An ingress replica opens its stream channel to one replica (``replicas/channel.py``): the
    request router sends it to ``replica`` (a Serve replica id) alone, books no load for it, and
    a replica with another id ends it at once."""

    ingress: str
    replica: str


#: One stream's tokens on a channel: (request id, offset, token ids), ``offset`` as
#: ``TokenChunk.offset``
ChannelPiece = tuple[str, int, list[int]]


#: The lowest log probability an engine reports (vLLM's OpenAI server clamps alike: -inf is not
#: JSON); also the value of a token the engine sent none for.
MIN_LOGPROB = -9999.0
#: One output token's log probability and its top alternatives, most likely first:
#: (logprob, ((token id, logprob), ...)); the alternatives are the call's ``logprobs`` most likely.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]
#: One prompt token's: its ``TokenLogprob`` and its rank among the vocabulary (1: the most likely),
#: which vLLM's ``prompt_logprobs`` lists: (logprob, alternatives, rank)
PromptLogprob = tuple[float, tuple[tuple[int, float], ...], int]


@dataclass(slots=True)
class EngineOutput:
    """What an engine yields per step for one request (delta token ids)."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int | None = None  # known once prefill has been scheduled
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the call asked for them
    # the prompt's, on the first output, when the call asked: None for its first token, which has no context
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class EngineStats:
    """A point-in-time view of one engine, for the gate's room check and the routing stats."""

    running: int  # requests in the engine (prefilling or decoding)
    prefilling: int  # admitted requests without a first token yet
    pending_prefill_tokens: int  # uncached prompt tokens admitted and not yet computed
    kv_blocks_total: int
    kv_blocks_free: int  # free or evictable (cached but unreferenced) blocks

    @property
    def kv_usage(self) -> float:
        if self.kv_blocks_total <= 0:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total


class ReplicaError(Exception):
    """Base of the errors a replica reports to the ingress; ``status`` is the HTTP status."""

    status: int = 500

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        """Keep every field across pickling (Ray sends it to the ingress), a subclass's own too:
        the message rebuilds the exception, the instance's fields are restored as its state."""
        return (type(self), (self.message,), dict(self.__dict__))


class Overloaded(ReplicaError):
    """The replica's waiting queue is full: HTTP 429 with Retry-After, at once. ``replica``: the
    refusing replica's Serve id, so the ingress can try the request once on another one (it never
    reached the engine)."""

    status = 429

    def __init__(self, message: str, retry_after_s: float | None = None, replica: str = "") -> None:
        super().__init__(message, retry_after_s)
        self.replica = replica


class PastWaitBound(ReplicaError):
    """The request waited in the replica's queue until its class's wait bound passed, unadmitted:
    HTTP 429 with Retry-After, and not tried elsewhere (its bound is spent)."""

    status = 429


class RequestTooLarge(ReplicaError):
    """The request can never fit this engine (KV capacity or context length): HTTP 400."""

    status = 400


class UnsupportedParameter(ReplicaError):
    """The engine cannot honour one of the request's parameters: HTTP 400 naming it (``param``:
    the request field, None when the engine does not say which)."""

    status = 400

    def __init__(self, message: str, retry_after_s: float | None = None, param: str | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.param = param


class EngineFailed(ReplicaError):
    """The engine failed while serving the request: HTTP 503 (retryable)."""

    status = 503


class EngineStalled(ReplicaError):
    """The engine made no progress for the gate's stall timeout while holding the request:
    HTTP 504 (retryable elsewhere; the replica reports itself unhealthy)."""

    status = 504


class Engine(ABC):
    """An engine behind the gate (``sim``, ``vllm`` or a ``module:Class``): every engine subclasses it.

    The gate decides *when* a request enters; the engine serves what it is given in arrival
    order. ``generate`` must start yielding only after the request is in the engine, and must
    finish (``finished=True``) or raise ``ReplicaError``; it never hangs on its own. The gate
    checks each request once before ``generate`` (an empty prompt, ``max_tokens < 1``, prompt +
    ``max_tokens`` over ``max_model_len``), so an engine refuses only what its own capacity cannot
    hold (more KV blocks than it has).

    Required: the four sizes and the abstract methods. Optional members have their defaults here,
    and an engine overrides those it has: ``healthy`` (True), ``preemptions`` (0), ``on_step``
    (None; an engine that can calls it after every step), ``time_scale`` (1.0),
    ``long_prefill_token_threshold`` (0), ``timing()`` (None), ``set_fault()``
    (applies none), and for engines with a host KV tier (``sim`` with ``host_kv_blocks``; ``vllm``
    with ``kv_events`` and CPU offloading) ``set_tier_listener(on_tier)`` (``on_tier`` gets
    ``(host_only, hash)`` transitions, after the stored / removed events of the same step) and
    ``host_only_hashes()`` (the hashes held in the host tier only): without a tier, no events and
    none held.
    """

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    #: the gate's pump (set by the gate): an engine that can calls it after every step, so waiting
    #: requests enter at step boundaries; the gate's ticker re-checks otherwise
    on_step: Callable[[], None] | None = None
    #: the replica's stream interval (set by the replica, ``replicas/stream.py``); an engine that
    #: ``coalesces`` holds a request's later outputs until this long after its previous one and
    #: yields them merged (the first and the finishing output at once), so its consumer wakes once
    #: per interval instead of once per step, and the replica does not merge them again
    stream_interval_s: float = 0.0
    coalesces: bool = False
    #: wall seconds per second of the hardware the engine stands for: 1 for a real engine, ``1 /
    #: speed`` for the sim engine slowed by its ``speed`` option; the gate's stall bound is in the
    #: hardware's seconds and scales by it, so a slowed engine's long steps are not taken for a stall
    time_scale: float = 1.0
    #: the most prompt tokens one request computes in a step (vLLM's
    #: ``long_prefill_token_threshold``); 0: no cap beyond the step's budget. The gate's
    #: first-step hold prices a pick's chunk with it
    long_prefill_token_threshold: int = 0

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    @abstractmethod
    def generate(self, call: GenerateCall) -> AsyncIterator[EngineOutput]: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def can_fit(self, prompt_tokens: int, block_hashes: Sequence[int]) -> bool:
        """Whether admitting this prompt now needs no more KV blocks than are free."""

    @abstractmethod
    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """The engine's (or the gate's best estimate of the) cached prefix of these hashes."""

    @abstractmethod
    def cached_hashes(self) -> list[int]:
        """Every block hash the engine's prefix cache holds (either tier): the set the stored /
        removed events describe, sent whole when the routers' shared view asks for it."""

    @abstractmethod
    def set_cache_listener(
        self,
        on_stored: Callable[[Iterable[int]], None],
        on_removed: Callable[[Iterable[int]], None],
    ) -> None:
        """Receive block-stored / block-removed events in the ``fairway/hashing.py`` hash space
        (exact for ``sim``; the vLLM adapter reports what it can observe)."""

    @property
    def healthy(self) -> bool:
        """Whether the engine runs; the replica's health check fails otherwise. Default: True."""
        return True

    @property
    def preemptions(self) -> int:
        """Requests the engine preempted so far (a metric). Default: 0."""
        return 0

    def timing(self) -> dict[str, float | str] | None:
        """How a real-time engine kept its pace (the sim engine), for the replica's ``info``;
        default: None."""
        return None

    def set_fault(self, stall: bool = False, slowdown: float = 1.0) -> bool:
        """Apply an injected fault (``replicas/faults.py``, a test hook); whether the engine
        applied it. Default: it applies none."""
        return False

    def set_tier_listener(self, on_tier: Callable[[Sequence[tuple[bool, int]]], None] | None) -> None:
        """Receive the host-tier events (class docstring). Default: no host tier, no events."""
        return None

    def host_only_hashes(self) -> list[int]:
        """The hashes held in the host KV tier only (class docstring). Default: [] (no tier)."""
        return []


@dataclass(slots=True)
class ReplicaRoutingStats:
    """What a replica reports to the request routers (Ray Serve's ``record_routing_stats``; the
    dataclass itself crosses Ray, and a router reads nothing else).

    ``taken_at`` is the replica's wall clock when taken. ``kv_usage`` (0-1), ``kv_blocks_total``
    and ``max_num_seqs`` are its engine's; ``drain_rate`` the cost-model prefill seconds its gate
    works off per wall second (``replicas/drain.py``).
    ``recent_cached`` maps recently finished request ids to the cached tokens they got: the
    feedback that corrects the routers' prefix-index estimates. ``waiting_ids`` are the requests
    still in the gate's queue at ``taken_at``: a router marks its other requests on this replica
    routed before ``taken_at`` as started, so its queued-work estimate follows the replica's real
    queue. ``prefilling`` maps the requests admitted into the engine and still without a first
    token at ``taken_at`` to their admission time (wall clock): a router dates their prefill from
    it and counts every other started request as past its prefill. ``admitted_ids`` are all the
    requests in the engine at ``taken_at`` (prefilling or past it): a request a router routed that
    is in none of the lists (nor in ``recent_cached``) has not reached the replica yet, so it is
    left queued; ``None``: not reported (every request off the waiting list counts as started).
    ``stalled``: the replica's engine is stalled (``replicas/gate.py``); routers avoid it.
    ``full``: the gate's estimated wait of its queue is at its bound (``max_queue_wait_s``), so it
    refuses new requests (429); routers leave it out while another replica is not full.
    """

    taken_at: float
    kv_usage: float
    kv_blocks_total: int
    max_num_seqs: int = 0
    recent_cached: dict[str, int] = field(default_factory=dict)
    waiting_ids: list[str] = field(default_factory=list)
    prefilling: dict[str, float] = field(default_factory=dict)
    admitted_ids: list[str] | None = None
    stalled: bool = False
    full: bool = False
    drain_rate: float = 1.0
