"""The HTTP ingress: an OpenAI-compatible API in front of the Fairway replicas.

Per request: validate the body (pydantic; 400 on bad JSON or fields, 404 on an unknown model),
refuse a text prompt too long in bytes to fit the context whatever its tokens (400, before any
tokenization: ``Tokenizer.max_text_bytes``), tokenize (the chat template for chat) in a thread pool
off the event loop (the Hugging Face tokenizer releases the GIL while it encodes, so one large
prompt does not stall every other client's stream), check the context length (400), hash the prompt's full
blocks (``fairway/hashing.py``), and call the replicas through a streaming Ray Serve handle whose
request router (``router/serve_router.py``) picks the replica from those hashes. Tokens stream
back as SSE (``stream: true``) or are collected into one response.

Errors are mapped, never swallowed: a full replica queue is 429 with Retry-After, Ray's own
back-pressure or a dead/unavailable replica is 503 with Retry-After, a request the engine can
never hold is 400. A failure after the stream started ends the stream with an error event and
``[DONE]``, so a client never hangs. A client that disconnects has its call cancelled at the
replica, which aborts the request in its gate and engine (queue slot and KV blocks freed).

Metrics (level "router"): TTFT as the client sees it (from the moment this ingress has the
request's headers, stamped by ``ReceivedAt``, to the first token here), per lane; end-to-end
latency; the ingress's own share (headers -> sent to the replicas); requests by status; rejects by
reason. docs/observability.md says where each of the replicas' timings starts and ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairway.clock import MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.hashing import block_hashes
from fairway.policies.classes import ClassesConfig
from fairway.protocol import (
    MIN_LOGPROB,
    GenerateCall,
    Overloaded,
    PastWaitBound,
    ReplicaError,
    TokenChunk,
    TokenLogprob,
    UnsupportedParameter,
)
from fairway.routing.held import HeldQueue
from router.auth import NO_AUTH, AuthArgs, AuthGuard, KeyTable, Principal
from router.detokenize import IncrementalDetokenizer, StopFilter
from router.hold import HoldArgs, Holder, HoldRefused
from router.limits import RequestGuard, RequestLimits
from router.openai_api import (
    DEFAULT_MAX_TOKENS,
    NO_AUTO,
    REFUSED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Tool,
    documented_errors,
    error_body,
    new_id,
    now_s,
    template_tools,
)
from router.responses_api import RESPONSES_REFUSED, ResponseEvents, ResponsesRequest, finished, to_chat, whole_output
from router.responses_api import head as responses_head
from router.responses_api import new_id as response_id
from router.responses_api import usage as responses_usage
from router.tokenizer import TooManyTokens, utf8_len_over
from router.tool_calls import AUTO, ToolCallAnswer

logger = logging.getLogger("ray.serve")
T = TypeVar("T")
#: the client's session key, for session-affinity routers (``session_of``)
SESSION_HEADER = "X-Session-Id"
#: a request's class by name when its body has no ``priority`` (docs/design.md, Flow control)
CLASS_HEADER = "X-Fairway-Class"
#: where ``ReceivedAt`` puts the time the ingress had a request's headers, in its ASGI scope state
RECEIVED_KEY = "fairway_received_s"

app = FastAPI(title="Fairway router", description="OpenAI-compatible API with KV-cache-aware Fairway routing")


def validation_reason(error: dict[str, Any], path: str = "") -> str:
    """The reject reason of a body that failed validation (its first error) on the route
    ``path``, for ``fairway_rejects_total``: "invalid_json", "unknown_field",
    "unsupported_parameter" (a documented parameter this server refuses on that route, ``n``
    above its bound included) or "bad_request"."""
    kind = error.get("type")
    if kind == "json_invalid":
        return "invalid_json"
    if kind == "extra_forbidden":
        return "unknown_field"
    loc = [x for x in error.get("loc", ()) if x != "body"]
    refused = RESPONSES_REFUSED if path == RESPONSES_PATH else REFUSED
    if len(loc) == 1 and (loc[0] in refused or loc[0] == "n"):
        return "unsupported_parameter"
    return "bad_request"


def count_reject(reason: str) -> None:
    """Count a request refused before it reached an ingress method (validation, limits, keys)
    in this ingress replica's reject metrics, as ``FairwayIngress._rejected`` counts the others."""
    stats = _current("stats", None)
    if stats is not None:
        stats.inc_reject(reason)
        stats.inc_requests("", "rejected")


#: FastAPI's message for a body it could not decode at all (not UTF-8, e.g. compressed)
BODY_PARSE_ERROR = "There was an error parsing the body"
RESPONSES_PATH = "/v1/responses"
#: What an unknown path's 404 lists
ROUTES = ("POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models, POST /tokenize, "
          "POST /detokenize, GET /health")


@app.exception_handler(RequestValidationError)
async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    count_reject(validation_reason(first, request.url.path))
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if first.get("type") == "json_invalid":
        msg = f"invalid JSON body: {first.get('msg', '')} at character {first.get('loc', ('', '?'))[-1]}"
        loc = ""
    else:
        detail = str(first.get("msg", "bad value")).removeprefix("Value error, ")
        ctype = request.headers.get("content-type", "")
        if not loc and ctype and "json" not in ctype.lower():
            # FastAPI parses JSON only without a content type or with a JSON one: a body of another
            # type (curl -d sends a form's) reaches validation as bytes
            detail = f"the body must be a JSON object sent as Content-Type: application/json (it came as {ctype!r})"
        msg = f"invalid request: {loc + ': ' if loc else ''}{detail}"
    return JSONResponse(error_body(msg, 400, loc or None), status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (a body it cannot parse, an unknown path or method) in OpenAI's
    error shape, like every other answer of this API, with a message that names the problem."""
    msg = str(exc.detail)
    if exc.status_code == 400 and msg == BODY_PARSE_ERROR:  # bytes that are not UTF-8 JSON at all
        encoding = request.headers.get("content-encoding", "")
        msg = (f"invalid request: the body is sent with Content-Encoding {encoding!r}, which this server does not "
               "decode; send it uncompressed" if encoding else
               "invalid JSON body: the body is not UTF-8 text; send a JSON object encoded as UTF-8")
        count_reject("invalid_json")
    elif exc.status_code == 404:
        msg = f"invalid URL ({request.method} {request.url.path}): this server serves {ROUTES}"
    elif exc.status_code == 405:
        allowed = {k.lower(): v for k, v in (getattr(exc, "headers", None) or {}).items()}.get("allow", "?")
        msg = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    return JSONResponse(error_body(msg, exc.status_code, code=None),  # not a model or queue error
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


class HTTPError(Exception):
    """An answer other than 200. ``refused_by``: the replica whose gate refused the request before
    its engine saw it (429, queue full), so it may be tried once on another replica."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, reason: str = "",
                 param: str | None = None, refused_by: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.param = param
        self.refused_by = refused_by

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after_s))))
        return JSONResponse(error_body(self.message, self.status, self.param), status_code=self.status,
                            headers=headers)


def map_error(e: BaseException) -> HTTPError:
    """A replica or Ray failure as the HTTP error the client gets."""
    cause = getattr(e, "cause", None)
    for x in (e, cause):
        if isinstance(x, UnsupportedParameter):
            return HTTPError(400, x.message, None, "unsupported_parameter", x.param)
        if isinstance(x, PastWaitBound):
            return HTTPError(429, x.message, x.retry_after_s, "past_bound")
        if isinstance(x, ReplicaError):
            reason = {429: "queue_full", 400: "too_long", 504: "stalled"}.get(x.status, "engine_failed")
            return HTTPError(x.status, x.message, x.retry_after_s if x.status in (429, 503) else None, reason,
                             refused_by=x.replica if isinstance(x, Overloaded) else "")
    name = type(e).__name__
    if name == "BackPressureError":
        return HTTPError(503, "the cluster is overloaded: too many requests queued; retry later", 1.0, "overloaded")
    if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "DeploymentUnavailableError"):
        return HTTPError(503, f"replica unavailable ({name}); retry", 1.0, "replica_dead")
    if isinstance(e, TimeoutError):
        return HTTPError(503, "request timed out in the cluster; retry", 1.0, "timeout")
    logger.exception("ingress: unexpected error", exc_info=e)
    return HTTPError(500, f"internal error: {name}: {e}", None, "internal")


def ingress_name() -> str:
    """This ingress replica's name ("ingress-<Serve replica id>"), or "ingress" outside Serve."""
    try:
        from ray import serve

        return "ingress-" + serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica
        return "ingress"


class ServedModel(BaseModel):
    """The served model as clients and the ingress see it; ``ClusterArgs`` has these keys too."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("fairway-tiny", description="the model name clients send")
    tokenizer: str = Field("deploy/models/fairway-tiny", description="tokenizer path or hub name")
    max_model_len: int = Field(32768, ge=16)
    block_size: int = Field(16, ge=1)
    tool_call_parser: Literal["llama3_json", "hermes"] | None = Field(
        None, description="how the model writes a tool call in free text (vLLM's parser names; router/tool_calls.py): "
        "llama3_json, Llama 3's JSON calls (what deploy/models/fairway-tiny's template asks for); hermes, "
        "<tool_call> blocks (Hermes, Qwen); without one, tool_choice auto is refused")


class IngressArgs(ServedModel):
    """What the ingress needs from the application's configuration (``cluster/config.py`` builds it)."""

    router_policy: str = Field("fairway", description="the request router's policy (a metrics label)")
    metrics: bool = True
    limits: RequestLimits = Field(default_factory=RequestLimits)
    auth: AuthArgs = Field(default_factory=AuthArgs)
    tokenizer_threads: int = Field(0, ge=0, description="threads that tokenize and render chat templates off "
                                                        "the event loop (0: one per CPU this process may use)")
    classes: ClassesConfig = Field(default_factory=ClassesConfig, description="request classes: each request's "
                                   "from its body's priority, the X-Fairway-Class header or its tenant")
    hold: HoldArgs = Field(default_factory=HoldArgs, description="the router's held queue (router/hold.py)")
    hold_policy: str = Field("fairway", description="the queue policy that orders held requests within a class "
                                                    "(the replicas' gate policy)")
    hold_policy_options: dict[str, Any] = Field(default_factory=dict)
    profile: str = Field(DEFAULT_PROFILE, description="the cost profile of the held queue's prefill estimates")
    gate_wait_s: float | None = Field(None, description="the replicas' max_queue_wait_s: the held queue leaves it "
                                                        "of each request's wait bound for the gate")


#: the period of ``watch_loop``'s timer, seconds
LOOP_WATCH_PERIOD_S = 0.1


async def watch_loop(stats: Any, period_s: float = LOOP_WATCH_PERIOD_S) -> None:
    """Observe, every ``period_s``, how late the event loop ran the timer (``observe_loop_lag``).
    Why: a request waits for a busy loop before its handler starts, and so before any timestamp
    of ours; this shows that wait (an overloaded ingress replica). O(1) per period."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period_s)
        stats.observe_loop_lag(loop.time() - t0 - period_s)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class FairwayIngress:
    """The ingress deployment's class (``cluster/app.py`` applies ``serve.ingress(app)``)."""

    def __init__(self, replicas: Any, args: IngressArgs | dict[str, Any]) -> None:
        from router.tokenizer import Tokenizer

        self.args = a = args if isinstance(args, IngressArgs) else IngressArgs(**args)
        # plain pickle both ways: every type crossing is importable here and in the replica
        # (fairway.protocol), and cloudpickle's per-object checks cost a stream's every item
        self.handle = replicas.options(stream=True, request_serialization="pickle",
                                       response_serialization="pickle")
        self.tokenizer = Tokenizer(a.tokenizer)
        self.max_text_bytes = self.tokenizer.max_text_bytes(a.max_model_len)
        self.tokenize_pool = ThreadPoolExecutor(a.tokenizer_threads or usable_cpus(), thread_name_prefix="tokenize")
        self.block_size = a.block_size
        self.keys = KeyTable(a.auth)
        self.name = ingress_name()
        self.stats = None
        self.exporter = None
        self._loop_watch: asyncio.Task | None = None
        if a.metrics:
            self._start_metrics()
        held = HeldQueue(MonotonicClock(), CostModel.from_profile(a.profile), a.classes, inner=a.hold_policy,
                         inner_options=a.hold_policy_options, max_held=a.hold.max_held, block_size=a.block_size)
        self.holder: Holder[_Stream] = Holder(held, self._probe, _Stream.close, self._hold_bound, a.hold.poll_s,
                                              stats=self.stats, margin_s=a.gate_wait_s or 0.0)

    def _start_metrics(self) -> None:
        from observability.exporter import MetricsExporter
        from observability.stats import FairwayStats

        name = self.name
        self.stats = FairwayStats(level="router", component=name, policy=self.args.router_policy)
        try:
            self.exporter = MetricsExporter([self.stats], component=name, level="router")
            self.exporter.start()
        except Exception as e:  # noqa: BLE001 - serving must not depend on metrics
            logger.warning("ingress: metrics endpoint not started: %s", e)

    # -- plain endpoints ---------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    def model_card(self) -> dict[str, Any]:
        """The served model as OpenAI's model object (with vLLM's ``max_model_len``)."""
        return {"id": self.args.model, "object": "model", "created": 0, "owned_by": "fairway",
                "max_model_len": self.args.max_model_len}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, model: str) -> JSONResponse:
        """``GET /v1/models/{model}`` (the openai client's ``models.retrieve``): the model object,
        or the 404 an unknown model gets on the generation endpoints (not counted as a refused
        request: nothing was asked to generate)."""
        try:
            self._check_model(model)
        except HTTPError as e:
            return e.response()
        return JSONResponse(self.model_card())

    async def metrics_targets(self) -> JSONResponse:
        from observability.exporter import metrics_targets

        return JSONResponse(metrics_targets())

    # -- generation --------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.args.model:
            raise HTTPError(404, f"the model `{model}` does not exist; this server serves `{self.args.model}`",
                            reason="unknown_model")

    def _class_of(self, body: CompletionRequest | ChatCompletionRequest, request: Request | None) -> str:
        """The request's class (``ClassesConfig.for_request``): its body's ``priority``, else the
        ``X-Fairway-Class`` header, else its tenant's default, else the cluster's; a 400 naming
        the valid ones for an unknown one. O(classes)."""
        header = request.headers.get(CLASS_HEADER, "") if request is not None else ""
        tenant = principal_of(request).tenant
        spec = self.args.auth.tenants.get(tenant) if tenant else None
        try:
            return self.args.classes.for_request(body.priority, header, spec.default_class if spec else "")
        except ValueError as e:
            where = "priority" if body.priority is not None else CLASS_HEADER
            raise HTTPError(400, f"{where}: {e}", reason="bad_request",
                            param="priority" if body.priority is not None else None) from None

    def _call(self, body: CompletionRequest | ChatCompletionRequest, ids: list[int], max_tokens: int,
              who: Principal = NO_AUTH, session: str = "", received_s: float = 0.0,
              priority_class: str = "") -> GenerateCall:
        n = len(ids)
        if n == 0:
            raise HTTPError(400, "prompt must not be empty", reason="bad_request")
        limit = self.args.max_model_len
        if n + max_tokens > limit:
            raise HTTPError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                 f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                                 f"Please reduce the length of the prompt or max_tokens.", reason="too_long")
        if max(ids) >= self.tokenizer.vocab_size:
            raise HTTPError(400, f"token id {max(ids)} is out of the vocabulary (size {self.tokenizer.vocab_size})",
                            reason="bad_request")
        vocab = self.tokenizer.vocab_size
        for name, extra_ids in (("stop_token_ids", body.stop_token_ids), ("logit_bias", body.logit_bias)):
            if extra_ids and max(extra_ids) >= vocab:
                raise HTTPError(400, f"{name}: token id {max(extra_ids)} is out of the vocabulary (size {vocab})",
                                reason="bad_request", param=name)
        if body.min_tokens > max_tokens:
            raise HTTPError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                            reason="bad_request", param="min_tokens")
        salt = who.salt(body.cache_salt)
        return GenerateCall(
            request_id=new_id("req"),
            prompt_token_ids=ids,
            block_hashes=tuple(block_hashes(ids, self.block_size, salt)),
            max_tokens=max_tokens,
            arrival_s=time.time(),
            model=body.model,
            temperature=body.temperature,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            cache_salt=salt,
            tenant=who.tenant,
            session=session,
            received_s=received_s,
            priority_class=priority_class,
            seed=body.seed,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.logit_bias,
            structured_output=body.structured_output(),
            structured_output_param=body.structured_output_param(),
            logprobs=body.logprob_count(),
            prompt_logprobs=body.prompt_logprob_count(),
        )

    def _watch_loop(self) -> None:
        """Start ``watch_loop`` on this replica's event loop, once (the constructor has no loop)."""
        if self._loop_watch is None and self.stats is not None:
            self._loop_watch = asyncio.get_running_loop().create_task(watch_loop(self.stats))

    async def completions(self, body: CompletionRequest, request: Request | None = None) -> Any:
        self._watch_loop()
        try:
            self._check_model(body.model)
            priority_class = self._class_of(body, request)
            prompts = body.prompts()
            self._check_choices(len(prompts), body.n)
            ids = [p if isinstance(p, list) else await self._text_ids(p) for p in prompts]
            calls = [self._call(body, list(x), body.max_tokens or DEFAULT_MAX_TOKENS, principal_of(request),
                                session_of(body, request), received_at(request), priority_class) for x in ids]
            echoes = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else "" for p in prompts]
        except HTTPError as e:
            return self._rejected(e)
        return await self._respond(self._answers(calls, body, chat=False, echoes=echoes), body, chat=False,
                                   request=request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request | None = None) -> Any:
        self._watch_loop()
        try:
            call = await self._chat_call(body, request)
        except HTTPError as e:
            return self._rejected(e)
        return await self._respond(self._answers([call], body, chat=True), body, chat=True, request=request)

    async def responses(self, body: ResponsesRequest, request: Request | None = None) -> Any:
        """``POST /v1/responses`` (router/responses_api.py): the request as the chat it stands
        for, answered as a Response object or its stream of events."""
        self._watch_loop()
        try:
            try:
                chat = to_chat(body)
            except ValueError as e:
                raise HTTPError(400, f"invalid request: {e}", reason="bad_request",
                                param=str(e).split(":", 1)[0]) from None
            call = await self._chat_call(chat, request)
        except HTTPError as e:
            return self._rejected(e)
        return await self._respond(self._answers([call], chat, chat=True), chat, chat=True, request=request,
                                   responses=body)

    async def _chat_call(self, body: ChatCompletionRequest, request: Request | None) -> GenerateCall:
        """A chat's engine call: its model, class, message count and tool choice checked, its
        messages through the chat template and tokenized; an HTTPError says what is wrong."""
        self._check_model(body.model)
        priority_class = self._class_of(body, request)
        cap = self.args.limits.max_messages
        if len(body.messages) > cap:
            raise HTTPError(400, f"too many messages: {len(body.messages)}; the limit is {cap}", reason="bad_request")
        if body.tool_choice == AUTO and self.args.tool_call_parser is None:
            raise HTTPError(400, f"invalid request: tool_choice: {NO_AUTO}", reason="unsupported_parameter",
                            param="tool_choice")
        self._check_choices(1, body.n)
        ids = await self._chat_ids(body.messages, body.tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # the rest of the context, as vLLM's and OpenAI's chat
            max_tokens = max(1, self.args.max_model_len - len(ids))
        return self._call(body, ids, max_tokens, principal_of(request), session_of(body, request),
                          received_at(request), priority_class)

    def _check_choices(self, prompts: int, n: int) -> None:
        """400 when the request's choices (prompts x n) are over ``limits.max_choices``."""
        cap = self.args.limits.max_choices
        if prompts * n > cap:
            raise HTTPError(400, f"too many choices: {prompts} prompt(s) x n={n} = {prompts * n}; the limit is {cap} "
                                 "(limits.max_choices)", reason="bad_request", param="n")

    def _answers(self, calls: list[GenerateCall], body: Any, chat: bool, echoes: list[str] | None = None
                 ) -> list[_Answer]:
        """Each prompt's ``n`` choices (index prompt x n + i), each its own call: the prompt's,
        and for i > 0 a copy with its own request id and, with a seed, seed + i (as vLLM seeds a
        prompt's choices). O(prompts x n)."""
        n = body.n
        out = []
        for k, call in enumerate(calls):
            for i in range(n):
                c = call if i == 0 else dataclasses.replace(
                    call, request_id=new_id("req"), seed=None if call.seed is None else call.seed + i)
                out.append(_Answer(self, c, k * n + i, body, chat, echoes[k] if echoes else ""))
        return out

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        """``POST /tokenize``: the ids this server would send the engine (``TokenizeRequest``),
        tokenized off the loop as a generation's prompt is."""
        try:
            if body.model is not None:
                self._check_model(body.model)
            if body.prompt is not None:
                ids = await self._text_ids(body.prompt)
            else:
                ids = await self._chat_ids(body.messages, body.tools, body.add_generation_prompt)
        except HTTPError as e:
            return e.response()
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.args.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.token_text(t) for t in ids]
        return JSONResponse(out)

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        """``POST /detokenize``: the ids' text, special tokens included, decoded off the loop; ids
        outside the vocabulary, or more than the context holds, are a 400."""
        try:
            if body.model is not None:
                self._check_model(body.model)
            vocab, limit = self.tokenizer.vocab_size, self.args.max_model_len
            if body.tokens and max(body.tokens) >= vocab:
                raise HTTPError(400, f"token id {max(body.tokens)} is out of the vocabulary (size {vocab})",
                                param="tokens")
            if len(body.tokens) > limit:
                raise HTTPError(400, f"{len(body.tokens)} tokens are more than the context holds ({limit})",
                                param="tokens")
        except HTTPError as e:
            return e.response()
        text = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.tokenizer.decode_all,
                                                                body.tokens)
        return JSONResponse({"prompt": text})

    async def _text_ids(self, text: str) -> list[int]:
        """A completion's text prompt as the engine gets it: its byte bound checked on the loop
        (``_check_text_bytes``), then tokenized off it (``_tokenized``)."""
        self._check_text_bytes(text)
        return await self._tokenized(self.tokenizer.encode_within, text)

    async def _chat_ids(self, messages: list[ChatMessage], tools: list[Tool] | None,
                        add_generation_prompt: bool = True) -> list[int]:
        """A chat's prompt as the engine gets it: the messages and tools through the chat template,
        the byte bound first, tokenized off the loop."""
        rendered = [m.for_template() for m in messages]
        self._check_text_bytes("".join(m["content"] for m in rendered))
        return await self._tokenized(functools.partial(self.tokenizer.encode_chat_within, tools=template_tools(tools),
                                                       add_generation_prompt=add_generation_prompt), rendered)

    def _check_text_bytes(self, text: str) -> None:
        """Refuse a text that cannot fit the context whatever its tokens (``max_text_bytes``), in
        O(1) for most texts and O(len) at worst (``utf8_len_over``), before it is tokenized."""
        bound = self.max_text_bytes
        if bound is None:
            return
        n = utf8_len_over(text, bound)
        if n is not None:
            limit = self.args.max_model_len
            raise HTTPError(400, f"This model's maximum context length is {limit} tokens. However, your prompt is "
                                 f"{n} bytes of text, more than {limit} tokens can hold (at most {bound} bytes: "
                                 f"{self.tokenizer.max_token_bytes} bytes per token). Please reduce the length of "
                                 f"the prompt.", reason="too_long")

    async def _tokenized(self, encode: Any, prompt: Any) -> list[int]:
        """``encode(prompt, max_model_len)`` off the loop; a prompt whose prefix alone is over the
        context (``Tokenizer.check_within``) is refused without tokenizing the rest."""
        limit = self.args.max_model_len
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, encode, prompt, limit)
        except TooManyTokens as e:
            raise HTTPError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                 f"at least {e.at_least} tokens. Please reduce the length of the prompt.",
                            reason="too_long") from None

    def _rejected(self, e: HTTPError, priority_class: str | None = None) -> JSONResponse:
        if self.stats is not None:
            self.stats.inc_reject(e.reason or str(e.status))
            self.stats.inc_requests("", "rejected")
            if priority_class is not None:
                self.stats.inc_class_reject(priority_class, e.reason or str(e.status))
        return e.response()

    # -- the held queue (router/hold.py) -------------------------------------------------------

    async def _probe(self, call: GenerateCall) -> _Stream:
        """Send a held ``call`` (``ack`` set); its stream once a gate has queued it. Each probe
        goes under its own Serve request id (``own_serve_request_id``): the held queue's rounds
        run in one task for every held request."""
        own_serve_request_id()
        stream = _Stream(self, call, self.handle.generate.remote(call))
        await self._or_close(stream, stream.accepted())  # cancelled (timed out): out of the gate's queue
        return stream

    def _hold_bound(self, call: GenerateCall) -> float:
        """How long after its headers ``call`` may wait for a replica's queue: its class's wait
        bound, else ``hold.max_wait_s``."""
        return self.args.classes.wait_bound_for(call.priority_class, self.args.hold.max_wait_s)

    async def _held(self, call: GenerateCall, refused: HTTPError | None) -> _Stream:
        """``call`` held until a gate takes it (``Holder.wait``); its refusal as an HTTPError."""
        try:
            stream, stream.held_s = await self.holder.wait(call, None if refused is None
                                                           else (refused.retry_after_s or 1.0))
        except HoldRefused as e:
            raise HTTPError(429, e.message, max(1.0, e.retry_after_s), e.reason) from None
        return stream

    async def _sent(self, call: GenerateCall, request: Request | None, sent: bool) -> tuple[_Stream, TokenChunk]:
        """``call`` sent to a replica, and its stream with the first chunk. A gate's refusal (its
        queue full, the engine never saw it) sends it once more, to another replica when one is a
        candidate; refused again, or while others are held, it is held until a gate takes it."""
        if len(self.holder) and self.holder.can_hold(call):  # others are held: it queues with them
            stream = await unless_gone(request, self._held(call, None))
            return stream, await self._first(stream, request, sent)
        refusal: HTTPError | None = None
        for _ in range(2):  # its pick, then once more with the refusing replica left out
            attempt = call
            if refusal is not None:
                attempt = dataclasses.replace(call, avoid=(refusal.refused_by,))
                if self.stats is not None:
                    self.stats.inc_retry(refusal.reason)
            stream = _Stream(self, attempt, self.handle.generate.remote(attempt))
            try:
                return stream, await self._first(stream, request, sent)
            except HTTPError as e:
                if not e.refused_by:
                    raise
                if refusal is None or (e.retry_after_s or 0) < (refusal.retry_after_s or 0):
                    refusal = e  # the shorter of the queues that refused it predicts its wait
        stream = await unless_gone(request, self._held(call, refusal))
        return stream, await self._first(stream, request, sent)

    @classmethod
    async def _first(cls, stream: _Stream, request: Request | None, sent: bool) -> TokenChunk:
        """The stream's first chunk, ended early when its client leaves (``_or_close``)."""
        return await cls._or_close(stream, unless_gone(request, stream.first(sent=sent)))

    @staticmethod
    async def _or_close(stream: _Stream, aw: Awaitable[T]) -> T:
        """``await aw``; on any failure but a gate's refusal (nothing runs then) the stream is
        closed, which stops the replica's work (its client left, it failed, or it timed out)."""
        try:
            return await aw
        except HTTPError as e:
            if not e.refused_by:
                stream.close()
            raise
        except BaseException:
            stream.close()
            raise

    async def _respond(self, answers: list[_Answer], body: Any, chat: bool, request: Request | None = None,
                       responses: ResponsesRequest | None = None) -> Any:
        """Send the answers' calls and answer them: one JSON body, or a stream (``_sse``). A
        request with several choices (``n``, a batch of prompts) sends each as its own call, all
        at once; one's failure ends the others (``_all``). ``responses``: the Responses API
        request the chat ``body`` stands for, answered in its shapes (``_response_object``,
        ``_response_events``)."""
        call = answers[0].call  # the choices share the request's arrival
        if self.stats is not None and call.received_s:
            self.stats.observe_ingress(call.arrival_s - call.received_s)
        streaming = False  # the streaming response owns the calls from its first frame on
        try:
            # the wait for the first token (queueing, prefill) and a whole answer's collection end
            # at once when the client goes away; a stream's own disconnects are seen by the
            # streaming response
            await self._all(answers, functools.partial(self._first_of, request=request, sent=not body.stream,
                                                       own_id=len(answers) > 1))
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                streaming = True
                events = (self._sse(answers, body, chat, include_usage) if responses is None
                          else self._response_events(answers[0], body, responses))
                return StreamingResponse(events, media_type="text/event-stream")
            await unless_gone(request, self._all(answers, self._collected))
        except HTTPError as e:
            return self._rejected(e, answers[0].call.priority_class)
        except ClientGone:
            return Response(status_code=CLIENT_GONE_STATUS)  # nobody reads it; the calls were cancelled
        finally:
            if not streaming:
                for a in answers:  # unfinished (its client left, or it failed): stop the replica's work
                    if a.stream is not None:
                        a.stream.close()
        if responses is not None:
            return JSONResponse(self._response_object(answers[0], body, responses))
        return JSONResponse(self._full(answers, body, chat))

    @staticmethod
    async def _all(answers: list[_Answer], step: Callable[[_Answer], Awaitable[None]]) -> None:
        """``step`` for every answer, at once; when one fails (or this is cancelled) the others
        are cancelled, and the failure raised. One answer: no task. O(answers)."""
        if len(answers) == 1:
            await step(answers[0])
            return
        tasks = [asyncio.ensure_future(step(a)) for a in answers]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _first_of(self, a: _Answer, request: Request | None, sent: bool, own_id: bool = False) -> None:
        if own_id:  # one of several choices, in its own task: its calls get their own Serve id
            own_serve_request_id()
        a.stream, a.first = await self._sent(a.call, request, sent)

    async def _collected(self, a: _Answer) -> None:
        assert a.stream is not None and a.first is not None
        a.text, a.last = await self._collect(a.stream, a.first, a.out)

    @staticmethod
    async def _collect(stream: _Stream, first: TokenChunk, out: _Output) -> tuple[str, TokenChunk]:
        """A whole answer's text and last chunk, ended early at a stop (the replica's call then
        ends at once). O(output): the pieces are joined once."""
        parts, last = [out.push(first)], first
        if not (first.finished or out.stopped):
            async for c in stream.rest():
                parts.append(out.push(c))
                last = c
                if out.stopped:
                    break
        if out.stopped:
            stream.stop()
        return "".join(parts), last

    # -- response shapes ---------------------------------------------------------------------

    @staticmethod
    def _filled(first: TokenChunk, last: TokenChunk) -> TokenChunk:
        """The chunk with the request's figures: the last when the answer ran to its end (the
        replica fills it), else the first token's (a stop ended the answer mid-stream)."""
        return last if last.finished else first

    def _usage(self, first: TokenChunk, last: TokenChunk, out: _Output) -> dict[str, Any]:
        """The answer's token counts; the completion's as far as a stop cut it."""
        src = self._filled(first, last)
        completion = len(out.ids) if out.stopped else last.completion_tokens
        return {
            "prompt_tokens": src.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": src.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": src.cached_tokens},
        }

    def _fairway(self, first: TokenChunk, last: TokenChunk, stream: _Stream) -> dict[str, Any]:
        src = self._filled(first, last)
        out = {"lane": src.lane, "promoted": src.promoted, "replica": src.replica,
               "queue_wait_s": src.queue_wait_s, "ttft_s": stream.ttft_s, "replica_ttft_s": src.ttft_s,
               "ingress": self.name}
        if stream.call.priority_class:
            out["class"] = stream.call.priority_class
        if stream.held_s:
            out["held_s"] = stream.held_s
        return out

    def _text_logprobs(self, ids: list[int], lps: list[TokenLogprob], start: int,
                       prompt: tuple[list[int], list[TokenLogprob | None] | None]) -> dict[str, Any]:
        """A completion's ``logprobs`` for ``ids`` (OpenAI's legacy shape, as vLLM writes it): each
        token's text, log probability, top alternatives (None when none were asked for) and
        character offset from ``start``, the offsets adding up the tokens' own texts. ``prompt``:
        the prompt's ids and the chunk's prompt entries; when the chunk has them (echo with
        logprobs, on the first chunk) they come first, offsets from 0, the first token's log
        probability None (it has no context). O(tokens x top)."""
        text_of = self.tokenizer.token_text

        def offsets_of(tokens: list[str], at: int) -> list[int]:
            out = []
            for tok in tokens:
                out.append(at)
                at += len(tok)
            return out

        entries: list[TokenLogprob | None] = list(aligned(ids, lps))
        tokens = [text_of(t) for t in ids]
        offsets = offsets_of(tokens, start)
        p_ids, p_entries = prompt
        if p_entries is not None:
            p_tokens = [text_of(t) for t in p_ids]
            tokens, offsets = p_tokens + tokens, offsets_of(p_tokens, 0) + offsets
            entries = (list(p_entries) + [None] * len(p_ids))[: len(p_ids)] + entries
        return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
                "top_logprobs": [None if e is None else ({text_of(t): v for t, v in e[1]} or None) for e in entries],
                "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any]:
        """A chat answer's ``logprobs`` for ``ids``: OpenAI's ``content`` list, each token with its
        text, UTF-8 bytes, log probability and top alternatives. O(tokens x top)."""
        text_of = self.tokenizer.token_text

        def entry(t: int, lp: float) -> dict[str, Any]:
            tok = text_of(t)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, (lp, top) in zip(ids, aligned(ids, lps), strict=True)]}

    def _full(self, answers: list[_Answer], body: Any, chat: bool) -> dict:
        """A whole answer's body: each answer's choice, the usage of them all, and the first
        answer's ``fairway`` figures (every choice's under ``choices`` when there are several)."""
        first = answers[0]
        assert first.first is not None and first.last is not None and first.stream is not None
        out = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now_s(),
            "model": first.call.model,
            "choices": [a.whole(body, chat) for a in answers],
            "usage": self._usage_of(answers, body.n),
            "fairway": self._fairway(first.first, first.last, first.stream),
        }
        if len(answers) > 1:
            out["fairway"]["choices"] = [self._fairway(a.first, a.last, a.stream) for a in answers]  # type: ignore
        return out

    def _usage_of(self, answers: list[_Answer], n: int) -> dict[str, Any]:
        """The answers' usage: each prompt's tokens (and cached tokens) once, as OpenAI and vLLM
        count them, the completions' tokens of every choice. O(answers)."""
        total = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        for a in answers:
            u = self._usage(a.first, a.last, a.out)  # type: ignore[arg-type]
            total["completion_tokens"] += u["completion_tokens"]
            if a.index % n == 0:  # the prompt's first choice
                total["prompt_tokens"] += u["prompt_tokens"]
                total["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
        return {"prompt_tokens": total["prompt_tokens"], "completion_tokens": total["completion_tokens"],
                "total_tokens": total["prompt_tokens"] + total["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": total["cached_tokens"]}}

    async def _sse(self, answers: list[_Answer], body: Any, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        rid = new_id("chatcmpl" if chat else "cmpl")
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now_s()
        model = body.model

        def frame(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                          "choices": choices, **extra}) + "\n\n"

        try:
            for a in answers:
                assert a.stream is not None and a.first is not None
                a.last = a.first
                yield frame([a.event(a.first, body, chat, a.echo, role=True) or {}])  # a first one always says
                a.stream.sent_first()  # the first event is written: the client has its first token
            if len(answers) == 1:
                a = answers[0]
                if not a.out.stopped:
                    async for c in a.stream.rest():  # type: ignore[union-attr]
                        a.last = c
                        if (ch := a.event(c, body, chat)) is not None:
                            yield frame([ch])
                        if a.out.stopped:
                            break
            else:
                async for a, c in merged(answers):
                    a.last = c
                    if (ch := a.event(c, body, chat)) is not None:
                        yield frame([ch])
            for a in answers:
                if a.out.stopped:
                    a.stream.stop()  # type: ignore[union-attr]
        except HTTPError as e:
            self._rejected(e)
            yield "data: " + json.dumps(error_body(e.message, e.status)) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            for a in answers:  # the client disconnected mid-stream: abort the requests at their replicas
                a.stream.close()  # type: ignore[union-attr]
        if include_usage:
            first = answers[0]
            yield frame([], usage=self._usage_of(answers, body.n),
                        fairway=self._fairway(first.first, first.last, first.stream))  # type: ignore[arg-type]
        yield "data: [DONE]\n\n"

    def _response_object(self, a: _Answer, body: ChatCompletionRequest, req: ResponsesRequest) -> dict[str, Any]:
        """A whole answer as a Responses API Response object (router/responses_api.py)."""
        assert a.first is not None and a.last is not None and a.stream is not None
        choice = a.whole(body, chat=True)
        status, details = finished(choice["finish_reason"])
        return {**responses_head(req, response_id("resp")), "status": status, "incomplete_details": details,
                "output": whole_output(choice["message"]), "usage": responses_usage(self._usage_of([a], 1)),
                "fairway": self._fairway(a.first, a.last, a.stream)}

    async def _response_events(self, a: _Answer, body: ChatCompletionRequest,
                               req: ResponsesRequest) -> AsyncIterator[str]:
        """A streamed answer as the Responses API's events (``ResponseEvents``), from the chat
        events the answer's chunks make; a failure after the start is ``response.failed``."""
        events = ResponseEvents(responses_head(req, response_id("resp")))
        reason: str | None = None

        def frames(evs: list[dict[str, Any]]) -> str:
            return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in evs)

        def on(ch: dict[str, Any] | None) -> list[dict[str, Any]]:
            nonlocal reason
            if ch is None:
                return []
            reason = ch["finish_reason"] or reason
            return events.delta(ch["delta"])

        assert a.stream is not None and a.first is not None
        try:
            a.last = a.first
            yield frames(events.start() + on(a.event(a.first, body, True, role=True)))
            a.stream.sent_first()  # the first events are written: the client has its first token
            if not a.out.stopped:
                async for c in a.stream.rest():
                    a.last = c
                    if evs := on(a.event(c, body, True)):
                        yield frames(evs)
                    if a.out.stopped:
                        break
            if a.out.stopped:
                a.stream.stop()
        except HTTPError as e:
            self._rejected(e)
            yield frames(events.failed(e.message, error_body(e.message, e.status)["error"].get("code")))
            return
        finally:
            a.stream.close()  # the client disconnected mid-stream: abort the request at its replica
        yield frames(events.finish(reason or a.out.finish_reason(a.last), self._usage_of([a], 1),
                                   fairway=self._fairway(a.first, a.last, a.stream)))


async def merged(answers: list[_Answer]) -> AsyncIterator[tuple[_Answer, TokenChunk]]:
    """The further chunks of every answer not yet ended, as they come; an answer ends at its
    finished chunk or at a stop its output found (the caller's ``event`` sets ``out.stopped``),
    and a failure of any raises here. Why: one stream of events for a request with several
    choices. O(1) per chunk; one task per answer."""
    queue: asyncio.Queue[tuple[_Answer, TokenChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(a: _Answer) -> None:
        try:
            async for c in a.stream.rest():  # type: ignore[union-attr]
                queue.put_nowait((a, c, None))
        except Exception as e:  # noqa: BLE001 - raised to the reader
            queue.put_nowait((a, None, e))

    live = {id(a): asyncio.ensure_future(pump(a)) for a in answers if not (a.out.stopped or a.first.finished)}  # type: ignore[union-attr]
    try:
        while live:
            a, c, err = await queue.get()
            if id(a) not in live:
                continue  # what came after its end
            if err is not None:
                raise err
            assert c is not None
            yield a, c
            if c.finished or a.out.stopped:
                live.pop(id(a)).cancel()
    finally:
        for t in live.values():
            t.cancel()


def own_serve_request_id() -> None:
    """Give the handle calls this task makes from now on a Serve internal request id of their
    own. Why: Ray Serve's request router keeps pending requests by that id, which a handle call
    takes from the request context, so every call made while serving one HTTP request shares it;
    two such calls waiting for a replica at once leave one never assigned, and Ray retries its
    routing forever (a request's n choices sent together hung so, the ingress at full CPU). The
    context is the task's own copy, so its caller's is untouched. O(1)."""
    ctx = serve_context._serve_request_context.get() or serve_context._RequestContext()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=new_id("fairway")))


def tool_answer(body: Any, chat: bool, parser: str | None = None) -> ToolCallAnswer | None:
    """The answer's tool calls, when its ``tool_choice`` is not none (router/tool_calls.py);
    ``parser``: the cluster's ``tool_call_parser``, which ``auto`` needs (checked before)."""
    mode = body.tool_mode() if chat else None
    return ToolCallAnswer(*mode, parser=parser) if mode is not None else None


#: A token the engine sent no log probability for (it cannot happen with the shipped engines,
#: which send one per token when asked): listed with the floor value and no alternatives.
NO_LOGPROB: TokenLogprob = (MIN_LOGPROB, ())


def aligned(ids: list[int], lps: list[TokenLogprob]) -> list[TokenLogprob]:
    """``lps`` with one entry per id (``NO_LOGPROB`` for any missing). O(1) when they match."""
    return lps if len(lps) == len(ids) else (lps + [NO_LOGPROB] * (len(ids) - len(lps)))[: len(ids)]


class _Output:
    """One answer's output as the client gets it, on any engine: the tokens detokenized
    incrementally, ended at the first stop token id (its text left out) or before the first
    stop string (``StopFilter``; with ``include_stop``, after it); neither counts among the first
    ``min_tokens`` tokens (vLLM's rule). O(chunk) per push, plus the stop strings' search."""

    def __init__(self, decode: Any, stops: list[str], stop_ids: list[int] | None, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.filter = StopFilter(stops, include_stop)
        self.stop_ids = frozenset(stop_ids or ())
        self.min_tokens = min_tokens
        self.ids: list[int] = []  # the output's token ids, to the stop token (included) when one ended it
        self.lps: list[TokenLogprob] = []  # their log probabilities, one per id, when the call asked
        self.stopped = False

    def push(self, c: TokenChunk) -> str:
        """The text ``c`` adds ('' once stopped)."""
        if self.stopped:
            return ""
        ids, final = c.token_ids, c.finished
        bar = min(len(ids), max(0, self.min_tokens - len(self.ids)))  # its first tokens that no stop may end
        at = next((j for j in range(bar, len(ids)) if ids[j] in self.stop_ids), -1) if self.stop_ids else -1
        counted = ids if at < 0 else ids[: at + 1]  # a stop token counts, its text is left out
        self.ids.extend(counted)
        if c.logprobs is not None:
            self.lps.extend(c.logprobs[: len(counted)])
        if at >= 0:
            ids, final, self.stopped = ids[:at], True, True
        text = ""
        if bar:  # the text of the answer's first min_tokens tokens: never searched for a stop string
            text = self.filter.push(self.detok.push(ids[:bar]), armed=False)
            ids = ids[bar:]
        rest = self.detok.push(ids)
        if final:
            rest += self.detok.finish()
        text += self.filter.push(rest, final=final)
        self.stopped = self.stopped or self.filter.stopped
        return text

    def finish_reason(self, last: TokenChunk) -> str:
        return "stop" if self.stopped else (last.finish_reason or "length")


class _Answer:
    """One choice of an answer on its way back: its call and stream, its output as the client
    gets it (``_Output``), its tool calls, its ``index`` among the choices, and the prompt text
    an ``echo`` puts first. A request has one per choice (prompts x ``n``). O(1) to build."""

    __slots__ = ("ingress", "call", "index", "echo", "out", "tools", "offset", "stream", "first", "last", "text")

    def __init__(self, ingress: FairwayIngress, call: GenerateCall, index: int, body: Any, chat: bool,
                 echo: str = "") -> None:
        self.ingress = ingress
        self.call = call
        self.index = index
        self.echo = echo
        self.out = _Output(ingress.tokenizer.decode, body.stop_strings(), body.stop_token_ids, body.min_tokens,
                           body.include_stop_str_in_output)
        self.tools = tool_answer(body, chat, ingress.args.tool_call_parser)
        self.offset = 0  # a completion's text so far, for its tokens' text_offset
        self.stream: _Stream | None = None
        self.first: TokenChunk | None = None
        self.last: TokenChunk | None = None
        self.text = ""  # a whole answer's output text

    def event(self, c: TokenChunk, body: Any, chat: bool, prefix: str = "",
              role: bool = False) -> dict[str, Any] | None:
        """The stream event's choice for chunk ``c``; None when it has nothing to say (a tool
        answer's held middle). O(chunk)."""
        out, call = self.out, self.call
        seen = len(out.ids)
        text = prefix + out.push(c)
        reason = out.finish_reason(c) if (c.finished or out.stopped) else None
        if chat:
            delta: dict[str, Any] | None
            if self.tools is not None:
                delta, reason = self.tools.delta(text, role, reason)
                if delta is None:  # held text; an event with a finish reason always goes
                    if call.logprobs is None and not body.return_token_ids and reason is None:
                        return None
                    delta = {}
            else:
                delta = {"content": text}
                if role:
                    delta["role"] = "assistant"
            ch: dict[str, Any] = {"index": self.index, "delta": delta, "finish_reason": reason}
            if call.logprobs is not None:
                ch["logprobs"] = self.ingress._chat_logprobs(out.ids[seen:], out.lps[seen:])
        else:
            lps = None
            if call.logprobs is not None:
                lps = self.ingress._text_logprobs(out.ids[seen:], out.lps[seen:], self.offset + len(prefix),
                                                  (call.prompt_token_ids, c.prompt_logprobs))
            self.offset += len(text)
            ch = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": reason}
        if body.return_token_ids:
            ch["token_ids"] = out.ids[seen:]
        return ch

    def whole(self, body: Any, chat: bool) -> dict[str, Any]:
        """A whole answer's choice. O(output)."""
        out, call, text = self.out, self.call, self.text
        assert self.first is not None and self.last is not None
        reason = out.finish_reason(self.last)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                message, reason = self.tools.message(text, reason)
            choice: dict[str, Any] = {"index": self.index, "message": message, "finish_reason": reason}
            if call.logprobs is not None:
                choice["logprobs"] = self.ingress._chat_logprobs(out.ids, out.lps)
        else:
            choice = {"index": self.index, "text": self.echo + text, "finish_reason": reason,
                      "logprobs": None if call.logprobs is None else self.ingress._text_logprobs(
                          out.ids, out.lps, len(self.echo), (call.prompt_token_ids, self.first.prompt_logprobs))}
        if body.return_token_ids:
            choice["token_ids"] = out.ids
            choice["prompt_token_ids"] = call.prompt_token_ids
        return choice


#: The status of a response nobody will read (the client went away first), nginx's convention.
CLIENT_GONE_STATUS = 499


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    """Return once ``request``'s client has disconnected (its body was read already, so the
    next ASGI message is ``http.disconnect``, sent when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request | None, aw: Awaitable[T]) -> T:
    """``await aw``, unless ``request``'s client disconnects first: then ``aw`` is cancelled and
    ``ClientGone`` raised. Why: the HTTP server does not cancel a handler whose client left, so
    without this a request whose client gave up still waits in a queue, and still runs. Two
    tasks per call."""
    if request is None:
        return await aw
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        gone.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientGone


class _Stream:
    """One request's token stream from its replica, with error mapping and router metrics."""

    def __init__(self, ingress: FairwayIngress, call: GenerateCall, gen: Any) -> None:
        self.ingress = ingress
        self.call = call
        self.gen = gen
        self.ttft_s = 0.0
        self.lane = ""
        self.replica = ""
        self.done = False
        self._early: TokenChunk | None = None  # a first chunk read by ``accepted``
        self.held_s = 0.0  # how long the router held it before a gate took it

    async def _next(self) -> TokenChunk:
        try:
            return await self.gen.__anext__()
        except StopAsyncIteration:
            raise HTTPError(503, "replica ended the stream without finishing the request", 1.0,
                            "engine_failed") from None
        except HTTPError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes an HTTP status
            raise map_error(e) from e

    async def first(self, sent: bool = True) -> TokenChunk:
        """The first chunk. Its TTFT is taken now when the answer is a whole one (``sent``), else
        by ``sent_first`` once the first event has been written (what a streaming client waits
        for)."""
        c, self._early = self._early or await self._next(), None
        self.ingress.holder.room()  # a prefill ended at its replica: that queue moved
        self.lane = c.lane
        self.replica = c.replica
        if self.ingress.stats is not None:
            self.ingress.stats.observe_queue_wait(c.lane, c.queue_wait_s, replica=c.replica)
        if sent:
            self.sent_first()
        if c.finished:
            self._finish("ok")
        return c

    async def accepted(self) -> None:
        """Return once the gate has queued the call (its ``accepted`` chunk; the call was sent
        with ``ack``); raises as ``first`` does, e.g. the gate's refusal."""
        c = await self._next()
        if not c.accepted:  # a replica that does not acknowledge: this is its first chunk
            self._early = c

    def sent_first(self) -> None:
        """Record the TTFT: from the headers (``ReceivedAt``) to now. O(1)."""
        self.ttft_s = max(0.0, time.time() - self.call.waited_from)
        st = self.ingress.stats
        if st is not None:
            st.observe_ttft(self.lane, self.ttft_s, replica=self.replica)
            name = self.call.priority_class
            if name:
                st.observe_class_ttft(name, self.ttft_s, self.ingress.args.classes.spec(name).objective_s, self.lane)

    async def rest(self) -> AsyncIterator[TokenChunk]:
        if self.done:
            return
        try:
            while True:
                c = await self._next()
                yield c
                if c.finished:
                    self._finish("ok")
                    return
        except HTTPError:
            self._finish("error")
            raise

    def stop(self) -> None:
        """End the call because its output is complete (a stop string or token ended it): the
        request counts as served, and the replica's generator is cancelled. O(1)."""
        if not self.done:
            self._finish("ok")
            self._cancel()

    def close(self) -> None:
        """End the call early if it has not finished (the client went away): cancel the
        replica's generator, which aborts the request in its gate and engine. O(1)."""
        if self.done:
            return
        self._finish("cancelled")
        self._cancel()

    def _cancel(self) -> None:
        try:
            self.gen.cancel()
        except Exception as e:  # noqa: BLE001 - the replica may already be gone
            logger.debug("ingress: cancel of %s failed: %s", self.call.request_id, e)

    def _finish(self, status: str) -> None:
        if self.done:
            return
        self.done = True
        self.ingress.holder.room()
        st = self.ingress.stats
        if st is not None:
            st.inc_requests(self.lane, status)
            if status == "ok":
                st.observe_e2e(self.lane, time.time() - self.call.waited_from,
                               replica=self.replica)


# -- routes ------------------------------------------------------------------------------------
# Module-level functions with the ingress instance injected, rather than FastAPI class-based
# views: with FastAPI >= 0.137 Ray Serve's class-view rewrite is lost when routes are resolved
# lazily in the replica process ("query.self: Field required").


def current_ingress() -> FairwayIngress:
    from ray import serve

    return serve.get_replica_context().servable_object


async def ingress_dependency() -> FairwayIngress:
    """``current_ingress`` as a FastAPI dependency: async, so FastAPI calls it on the event loop
    (a plain function would cost a worker-thread hop per request)."""
    return current_ingress()


class ReceivedAt:
    """ASGI middleware, the outermost: stamps the wall time this ingress had the request's
    headers into its scope (``received_at``), where the client's wait starts; everything after it
    (the guards, the body, validation, tokenization) counts toward the TTFT it exports. O(1)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[RECEIVED_KEY] = time.time()
        await self.app(scope, receive, send)


def received_at(request: Request | None) -> float:
    """The wall time ``ReceivedAt`` stamped on ``request`` (0 when unknown: no middleware ran)."""
    if request is None:
        return 0.0
    return request.scope.get("state", {}).get(RECEIVED_KEY, 0.0)


def principal_of(request: Request | None) -> Principal:
    """Who sent ``request``, as ``AuthGuard`` found it (``NO_AUTH`` without keys)."""
    if request is None:
        return NO_AUTH
    return request.scope.get("state", {}).get("principal", NO_AUTH)


def session_of(body: CompletionRequest | ChatCompletionRequest, request: Request | None) -> str:
    """The request's session key for session-affinity routers (``session-hash``): the
    ``X-Session-Id`` header, else the OpenAI body's ``prompt_cache_key`` (OpenAI's own key for
    requests that share a prefix), else its ``user`` field, else "" (none)."""
    header = request.headers.get(SESSION_HEADER, "") if request is not None else ""
    return header or body.prompt_cache_key or body.user or ""


def _current(attr: str, default: Any) -> Any:
    """An attribute of this ingress replica (``default`` outside a Serve replica, or before it
    is constructed): the guards read its limits and keys per request."""
    try:
        return getattr(current_ingress(), attr)
    except Exception:  # noqa: BLE001 - not in a replica, or not constructed yet
        return default


def current_keys() -> KeyTable | None:
    """This ingress replica's API keys (None outside a Serve replica: nothing is checked)."""
    return _current("keys", None)


def current_limits() -> RequestLimits:
    """This ingress replica's request limits (the defaults outside a Serve replica)."""
    args = _current("args", None)
    return args.limits if args is not None else RequestLimits()


app.add_middleware(RequestGuard, limits=current_limits, on_reject=count_reject)
app.add_middleware(AuthGuard, keys=current_keys, on_reject=count_reject)  # no body read for a bad key
app.add_middleware(ReceivedAt)  # outermost: the client's wait starts before any guard


Ingress = Annotated[FairwayIngress, Depends(ingress_dependency)]


#: The error statuses each kind of route may answer (the OpenAPI schema lists them; FastAPI's own
#: 422 is never sent: a body that fails validation gets 400, as OpenAI's API answers)
OPEN_ERRORS = documented_errors(431)  # no key checked, no body read
KEYED_ERRORS = documented_errors(401, 403, 431)
GENERATION_ERRORS = documented_errors(400, 401, 403, 404, 408, 413, 429, 431, 500, 503, 504)
#: A generation's 200: the completion as JSON, or with ``stream: true`` its server-sent events
GENERATION_ANSWERS = {200: {"description": "the completion; with stream: true, server-sent events (data: chunk "
                                           "JSON lines, then data: [DONE])",
                            "content": {"text/event-stream": {"schema": {  # one event
                                "type": "object", "required": ["data"],
                                "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}},
                      **GENERATION_ERRORS}
#: A Responses API 200: the Response object, or with stream: true its typed events
RESPONSES_ANSWERS = {200: {"description": "the Response; with stream: true, server-sent events (event: <type>, "
                                          "data: the event's JSON), the last response.completed, .incomplete or "
                                          ".failed",
                           "content": GENERATION_ANSWERS[200]["content"]},
                     **GENERATION_ERRORS}


@app.get("/health", responses=OPEN_ERRORS)
async def health(ingress: Ingress) -> JSONResponse:
    return await ingress.health()


@app.get("/v1/models", responses=KEYED_ERRORS)
async def models(ingress: Ingress) -> JSONResponse:
    return await ingress.models()


@app.get("/v1/models/{model:path}", responses={**KEYED_ERRORS, **documented_errors(404)})
async def model(model: str, ingress: Ingress) -> JSONResponse:
    return await ingress.model(model)


@app.get("/metrics/targets", responses=OPEN_ERRORS)
async def metrics_targets(ingress: Ingress) -> JSONResponse:
    return await ingress.metrics_targets()


@app.post("/tokenize", responses=documented_errors(400, 401, 403, 404, 408, 413, 431))
async def tokenize(body: TokenizeRequest, ingress: Ingress) -> JSONResponse:
    return await ingress.tokenize(body)


@app.post("/detokenize", responses=documented_errors(400, 401, 403, 404, 408, 413, 431))
async def detokenize(body: DetokenizeRequest, ingress: Ingress) -> JSONResponse:
    return await ingress.detokenize(body)


@app.post("/v1/completions", responses=GENERATION_ANSWERS)
async def completions(body: CompletionRequest, ingress: Ingress, request: Request) -> Any:
    return await ingress.completions(body, request)


@app.post("/v1/chat/completions", responses=GENERATION_ANSWERS)
async def chat_completions(body: ChatCompletionRequest, ingress: Ingress, request: Request) -> Any:
    return await ingress.chat_completions(body, request)


@app.post(RESPONSES_PATH, responses=RESPONSES_ANSWERS)
async def responses(body: ResponsesRequest, ingress: Ingress, request: Request) -> Any:
    return await ingress.responses(body, request)


def openapi_schema() -> dict[str, Any]:
    """FastAPI's schema of this app without its 422 responses (and their validation-error
    models): this API answers a body that fails validation with 400 and OpenAI's error object,
    listed per route by ``documented_errors``. Built once."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        models = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        for title, model in models.items():  # a refused parameter says which values it takes (400 for others)
            table = RESPONSES_REFUSED if title.startswith("ResponsesRequest") else REFUSED
            for name, prop in model.get("properties", {}).items():
                if name in table:
                    prop["description"] = f"accepted only with no effect; otherwise 400: {table[name][1]}"
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = openapi_schema  # type: ignore[method-assign]
