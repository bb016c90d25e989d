"""The HTTP ingress: an OpenAI-compatible API in front of the Fairway replicas.

Per request: validate the body (pydantic; 400 on bad JSON or fields, 404 on an unknown model),
refuse a text prompt too long in bytes to fit the context whatever its tokens (400, before any
tokenization: ``Tokenizer.max_text_bytes``), tokenize (the chat template for chat) in a thread pool
off the event loop (the Hugging Face tokenizer releases the GIL while it encodes, so one large
prompt does not stall every other client's stream), check the context length (400), hash the prompt's full
blocks (``fairway/hashing.py``), and call the replicas through a streaming Ray Serve handle whose
request router (``router/serve_router.py``) picks the replica from those hashes. Tokens stream
back as SSE (``stream: true``) or are collected into one response.

The parts: this module holds the FastAPI app, its routes and guards, and ``FairwayIngress``,
which turns a request into engine calls (``GenerateCall``: one per choice), sends them (a gate's
refusal tried once elsewhere, then held: ``router/hold.py``) and answers. A call's stream and its
client's leaving are ``router/calls.py``; the errors and how failures map onto them,
``router/errors.py`` (mapped, never swallowed); the answer in each route's shape, whole or
streamed, ``router/answers.py`` (a failure after the stream started ends it with an error
event, so a client never hangs); the request and response models, ``router/openai_api.py`` and
``router/responses_api.py``.

Metrics (level "router"): TTFT as the client sees it (from the moment this ingress has the
request's headers, stamped by ``ReceivedAt``, to the first token here), per lane; end-to-end
latency; the ingress's own share (headers -> sent to the replicas); requests by status; rejects by
reason. docs/observability.md says where each of the replicas' timings starts and ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairway.clock import MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.hashing import block_hashes
from fairway.policies.classes import ClassesConfig
from fairway.protocol import (
    GenerateCall,
    TokenChunk,
)
from fairway.routing.held import HeldQueue
from router.answers import Answer, Output, Replies
from router.auth import NO_AUTH, AuthArgs, AuthGuard, KeyTable, Principal
from router.calls import CLIENT_GONE_STATUS, ClientGone, ReplicaStream, own_serve_request_id, unless_gone
from router.channels import StreamChannels
from router.cors import CorsArgs, CorsGuard
from router.errors import HTTPError
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
    error_text,
    new_id,
    template_tools,
)
from router.responses_api import AS_RESPONSES_PARAM, RESPONSES_REFUSED, MappingError, ResponsesRequest, to_chat
from router.tokenizer import DEFAULT_TRUNCATION_SIDE, PREFIX_CHARS_PER_TOKEN, TooManyTokens, kept, utf8_len_over
from router.tool_calls import AUTO
from router.work_pool import TOKENIZE_S_PER_CHAR, ShortestFirstPool

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
        detail = error_text(first)
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
    cors: CorsArgs = Field(default_factory=CorsArgs, description="browsers' cross-origin access (router/cors.py)")
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
    stream_channel: bool = Field(False, description="one stream channel per replica carries the middle chunks of "
                                                    "every stream (router/channels.py; needs Fairway's request router, "
                                                    "which pins it)")


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
        # shortest tokenizations first: one client's long prompts cannot hold up everyone's short ones
        self.tokenize_pool = ShortestFirstPool(a.tokenizer_threads or usable_cpus(), name="tokenize")
        self.block_size = a.block_size
        self.keys = KeyTable(a.auth)
        self.name = ingress_name()
        # one stream channel per replica (router/channels.py): the middle chunks of every stream
        self.channels = StreamChannels(self.name, lambda c: self.handle.channel.remote(c)) if a.stream_channel else None
        self.stats = None
        self.exporter = None
        self._loop_watch: asyncio.Task | None = None
        self.replies = Replies(self.name, self._rejected)
        if a.metrics:
            self._start_metrics()
        held = HeldQueue(MonotonicClock(), CostModel.from_profile(a.profile), a.classes, inner=a.hold_policy,
                         inner_options=a.hold_policy_options, max_held=a.hold.max_held, block_size=a.block_size)
        self.holder: Holder[ReplicaStream] = Holder(held, self._probe, ReplicaStream.close, self._hold_bound,
                                                    a.hold.poll_s, stats=self.stats, margin_s=a.gate_wait_s or 0.0)

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
        the valid ones for an unknown one, a 403 naming the tenant's own for one it may not use
        (``auth.tenants.<name>.classes``). O(classes)."""
        header = request.headers.get(CLASS_HEADER, "") if request is not None else ""
        tenant = principal_of(request).tenant
        spec = self.args.auth.tenants.get(tenant) if tenant else None
        param = "priority" if body.priority is not None else None
        where = param or CLASS_HEADER
        try:
            name = self.args.classes.for_request(body.priority, header, spec.default_class if spec else "")
        except ValueError as e:
            raise HTTPError(400, f"{where}: {e}", reason="bad_request", param=param) from None
        if spec is not None and spec.classes and name not in spec.classes:
            raise HTTPError(403, f"{where}: tenant {tenant!r} may not use request class {name!r}; its classes: "
                                 f"{', '.join(spec.classes)}", reason="forbidden", param=param)
        return name

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
        for name, extra_ids in (("stop_token_ids", body.stop_token_ids), ("logit_bias", body.logit_bias),
                                ("allowed_token_ids", body.allowed_token_ids)):
            if extra_ids and max(extra_ids) >= vocab:
                raise HTTPError(400, f"{name}: token id {max(extra_ids)} is out of the vocabulary (size {vocab})",
                                reason="bad_request", param=name)
        if body.min_tokens > max_tokens:
            raise HTTPError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                            reason="bad_request", param="min_tokens")
        salt = who.salt(body.cache_salt)
        constraint, constraint_param = body.output_constraint()
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
            # a set of ids, sent once each: what reaches the engine is bounded by the vocabulary
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(sorted(set(body.allowed_token_ids))),
            bad_words=tuple(body.bad_words or ()),
            structured_output=constraint,
            structured_output_param=constraint_param,
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
            keep = self._kept(body)
            ids = [kept(p, keep) if isinstance(p, list) else await self._text_ids(p, body.add_special_tokens, keep)
                   for p in prompts]
            calls = [self._call(body, list(x), body.max_tokens or DEFAULT_MAX_TOKENS, principal_of(request),
                                session_of(body, request), received_at(request), priority_class) for x in ids]
            # the prompt as the engine has it: its text as sent, or its kept tokens' text
            echoes = [(p if isinstance(p, str) and keep is None else self.tokenizer.decode(x)) if body.echo else ""
                      for p, x in zip(prompts, ids, strict=True)]
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
            except MappingError as e:
                raise HTTPError(400, f"invalid request: {e}", reason="bad_request", param=e.param) from None
            call = await self._chat_call(chat, request,
                                         body.fixed_messages() if body.truncation == "auto" else None)
        except HTTPError as e:
            return self._rejected(e)
        return await self._respond(self._answers([call], chat, chat=True), chat, chat=True, request=request,
                                   responses=body)

    async def _chat_call(self, body: ChatCompletionRequest, request: Request | None,
                         fixed: int | None = None) -> GenerateCall:
        """A chat's engine call: its model, class and tool choice checked (its message count was, as
        the body was validated: ``BodyFacts.max_items``), its messages through the chat template and
        tokenized; an HTTPError says what is wrong. ``fixed`` (the Responses API's ``truncation:
        auto``): the oldest messages after the first ``fixed`` are dropped until the prompt leaves
        room for ``max_tokens`` (one token without it) in the context."""
        self._check_model(body.model)
        priority_class = self._class_of(body, request)
        if body.tool_choice == AUTO and self.args.tool_call_parser is None:
            raise HTTPError(400, f"invalid request: tool_choice: {NO_AUTO}", reason="unsupported_parameter",
                            param="tool_choice")
        self._check_choices(1, body.n)
        max_tokens = body.max_completion_tokens or body.max_tokens
        fit = None if fixed is None else (fixed, self.args.max_model_len - (max_tokens or 1))
        ids = await self._chat_ids(body.messages, body.tools, body.template_options(), body.add_special_tokens,
                                   self._kept(body), fit)
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
                 ) -> list[Answer]:
        """Each prompt's ``n`` choices (index prompt x n + i), each its own call: the prompt's,
        and for i > 0 a copy with its own request id and, with a seed, seed + i (as vLLM seeds a
        prompt's choices). O(prompts x n)."""
        n = body.n
        out = []
        for k, call in enumerate(calls):
            for i in range(n):
                c = call if i == 0 else dataclasses.replace(
                    call, request_id=new_id("req"), seed=None if call.seed is None else call.seed + i)
                out.append(Answer(self.tokenizer, self.args.tool_call_parser, c, k * n + i, body, chat,
                                  echoes[k] if echoes else ""))
        return out

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        """``POST /tokenize``: the ids this server would send the engine (``TokenizeRequest``),
        tokenized off the loop as a generation's prompt is."""
        try:
            if body.model is not None:
                self._check_model(body.model)
            if body.prompt is not None:
                ids = await self._text_ids(body.prompt, body.special_tokens())
            else:
                ids = await self._chat_ids(body.messages, body.tools, body.template_options(), body.special_tokens())
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
        # its turn by its text's length, about 4 characters a token
        text = await self._on_tokenizer(4 * len(body.tokens), self.tokenizer.decode_all, body.tokens)
        return JSONResponse({"prompt": text})

    def _kept(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[int, str] | None:
        """vLLM's ``truncate_prompt_tokens``: how many of the prompt's tokens are kept and from which
        side ("left", the default: the last ones; "right": the first), or None to keep them all; more
        than the context is a 400 naming it, -1 the context less one (room for one output token)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return None
        limit = self.args.max_model_len
        if k > limit:
            raise HTTPError(400, f"truncate_prompt_tokens ({k}) is more than this model's context ({limit} tokens)",
                            reason="bad_request", param="truncate_prompt_tokens")
        return (limit - 1 if k == -1 else k), body.truncation_side or DEFAULT_TRUNCATION_SIDE

    async def _text_ids(self, text: str, add_special_tokens: bool = False,
                        keep: tuple[int, str] | None = None) -> list[int]:
        """A completion's text prompt as the engine gets it (``add_special_tokens``: with the
        tokenizer's own around it): its byte bound checked on the loop (``_check_text_bytes``), then
        tokenized off it (``_tokenized``); with ``keep`` (``_kept``), only the kept side's tokens,
        of a text of any length under the body limit (``Tokenizer.encode_kept``)."""
        if keep is not None:
            return await self._on_tokenizer(min(len(text), PREFIX_CHARS_PER_TOKEN * keep[0]),
                                            self.tokenizer.encode_kept, text, *keep, add_special_tokens)
        self._check_text_bytes(text)
        return await self._tokenized(functools.partial(self.tokenizer.encode_within,
                                                       add_special_tokens=add_special_tokens), text, len(text))

    async def _chat_ids(self, messages: list[ChatMessage], tools: list[Tool] | None, template: dict[str, Any],
                        add_special_tokens: bool = False, keep: tuple[int, str] | None = None,
                        fit: tuple[int, int] | None = None) -> list[int]:
        """A chat's prompt as the engine gets it: the messages and tools through the chat template
        (with the request's ``template`` options; ``add_special_tokens``: the tokenizer's own around
        it too), the byte bound first, tokenized off the loop; with ``keep``, the rendered prompt's
        kept tokens (``_text_ids``); with ``fit`` = (messages kept, budget), the oldest other
        messages dropped until it is within the budget (``Tokenizer.encode_chat_fitting``)."""
        rendered = [m.for_template() for m in messages]
        text = "".join(m["content"] for m in rendered)
        tools_json = template_tools(tools)
        if fit is not None:
            fixed, budget = fit
            try:
                return await self._on_tokenizer(len(text), functools.partial(
                    self.tokenizer.encode_chat_fitting, budget=budget, fixed=fixed, tools=tools_json,
                    template=template, add_special_tokens=add_special_tokens), rendered)
            except TooManyTokens as e:
                limit = self.args.max_model_len
                raise HTTPError(400, f"This model's maximum context length is {limit} tokens, {limit - budget} of "
                                     f"them kept for the output. With truncation auto, the instructions and the "
                                     f"input's last item alone still have at least {e.at_least} tokens. Please "
                                     f"shorten them or lower max_output_tokens.", reason="too_long",
                                param="input") from None
        if keep is not None:
            def encode_kept(rendered: list[dict[str, Any]]) -> list[int]:
                prompt = self.tokenizer.render_chat(rendered, tools_json, template)
                return self.tokenizer.encode_kept(prompt, *keep, add_special_tokens)
            return await self._on_tokenizer(len(text), encode_kept, rendered)
        self._check_text_bytes(text)
        return await self._tokenized(functools.partial(self.tokenizer.encode_chat_within, tools=tools_json,
                                                       template=template, add_special_tokens=add_special_tokens),
                                     rendered, len(text))

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

    def _on_tokenizer(self, chars: int, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """``fn(*args)`` on the tokenizer threads, its turn by the ``chars`` of text it handles (the
        shortest first: ``router/work_pool.py``)."""
        return asyncio.wrap_future(self.tokenize_pool.submit_costed(chars * TOKENIZE_S_PER_CHAR, fn, *args))

    async def _tokenized(self, encode: Any, prompt: Any, chars: int) -> list[int]:
        """``encode(prompt, max_model_len)`` off the loop, its turn by its ``chars`` (the shortest
        first: ``router/work_pool.py``); a prompt whose prefix alone is over the context
        (``Tokenizer.check_within``) is refused without tokenizing the rest."""
        limit = self.args.max_model_len
        try:
            return await self._on_tokenizer(chars, encode, prompt, limit)  # type: ignore[no-any-return]
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

    async def _probe(self, call: GenerateCall) -> ReplicaStream:
        """Send a held ``call`` (``ack`` set); its stream once a gate has queued it. Each probe
        goes under its own Serve request id (``own_serve_request_id``): the held queue's rounds
        run in one task for every held request."""
        own_serve_request_id()
        stream = self._stream(call)
        await self._or_close(stream, stream.accepted())  # cancelled (timed out): out of the gate's queue
        return stream

    def _stream(self, call: GenerateCall) -> ReplicaStream:
        """``call`` sent to a replica through the handle (its request router picks which), as a
        stream; its middle chunks on the replica's stream channel, when this ingress has them and
        the call asks for no log probabilities (they stay beside their tokens, on the call)."""
        channels = self.channels if call.logprobs is None and call.prompt_logprobs is None else None
        call.channel = channels.name if channels is not None else ""
        return ReplicaStream(call, self.handle.generate.remote(call), self.holder, self.stats, self.args.classes,
                             channels)

    def _hold_bound(self, call: GenerateCall) -> float:
        """How long after its headers ``call`` may wait for a replica's queue: its class's wait
        bound, else ``hold.max_wait_s``."""
        return self.args.classes.wait_bound_for(call.priority_class, self.args.hold.max_wait_s)

    async def _held(self, call: GenerateCall, refused: HTTPError | None) -> ReplicaStream:
        """``call`` held until a gate takes it (``Holder.wait``); its refusal as an HTTPError."""
        try:
            stream, stream.held_s = await self.holder.wait(call, None if refused is None
                                                           else (refused.retry_after_s or 1.0))
        except HoldRefused as e:
            raise HTTPError(429, e.message, max(1.0, e.retry_after_s), e.reason) from None
        return stream

    async def _sent(self, call: GenerateCall, request: Request | None, sent: bool) -> tuple[ReplicaStream, TokenChunk]:
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
            stream = self._stream(attempt)
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
    async def _first(cls, stream: ReplicaStream, request: Request | None, sent: bool) -> TokenChunk:
        """The stream's first chunk, ended early when its client leaves (``_or_close``)."""
        return await cls._or_close(stream, unless_gone(request, stream.first(sent=sent)))

    @staticmethod
    async def _or_close(stream: ReplicaStream, aw: Awaitable[T]) -> T:
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

    async def _respond(self, answers: list[Answer], body: Any, chat: bool, request: Request | None = None,
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
                options = body.stream_options
                streaming = True
                events = (self.replies.sse(answers, body, chat, bool(options and options.include_usage),
                                           bool(options and options.continuous_usage_stats)) if responses is None
                          else self.replies.response_events(answers[0], body, responses))
                return StreamingResponse(events, media_type="text/event-stream")
            await unless_gone(request, self._all(answers, self._collected))
        except HTTPError as e:
            if responses is not None and e.param in AS_RESPONSES_PARAM:  # named in the Responses request's words
                e = HTTPError(e.status, f"{AS_RESPONSES_PARAM[e.param]}: {e.message}", e.retry_after_s, e.reason,
                              AS_RESPONSES_PARAM[e.param])
            return self._rejected(e, answers[0].call.priority_class)
        except ClientGone:
            return Response(status_code=CLIENT_GONE_STATUS)  # nobody reads it; the calls were cancelled
        finally:
            if not streaming:
                for a in answers:  # unfinished (its client left, or it failed): stop the replica's work
                    if a.stream is not None:
                        a.stream.close()
        if responses is not None:
            return JSONResponse(self.replies.response_object(answers[0], body, responses))
        return JSONResponse(self.replies.whole(answers, body, chat))

    @staticmethod
    async def _all(answers: list[Answer], step: Callable[[Answer], Awaitable[None]]) -> None:
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

    async def _first_of(self, a: Answer, request: Request | None, sent: bool, own_id: bool = False) -> None:
        if own_id:  # one of several choices, in its own task: its calls get their own Serve id
            own_serve_request_id()
        a.stream, a.first = await self._sent(a.call, request, sent)

    async def _collected(self, a: Answer) -> None:
        assert a.stream is not None and a.first is not None
        a.text, a.last = await self._collect(a.stream, a.first, a.out)

    @staticmethod
    async def _collect(stream: ReplicaStream, first: TokenChunk, out: Output) -> tuple[str, TokenChunk]:
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


def current_cors() -> CorsArgs:
    """This ingress replica's cross-origin settings (off outside a Serve replica)."""
    args = _current("args", None)
    return args.cors if args is not None else CorsArgs()


def current_limits() -> RequestLimits:
    """This ingress replica's request limits (the defaults outside a Serve replica)."""
    args = _current("args", None)
    return args.limits if args is not None else RequestLimits()


app.add_middleware(RequestGuard, limits=current_limits, on_reject=count_reject)
app.add_middleware(AuthGuard, keys=current_keys, on_reject=count_reject)  # no body read for a bad key
app.add_middleware(CorsGuard, cors=current_cors)  # a browser's preflight is answered without a key
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


#: What a stored response's routes answer: none is kept here (router/responses_api.py)
NOT_STORED = ("responses are not stored by this server, so none can be retrieved, cancelled, deleted or listed; "
              "send the conversation so far as input")


STORED_ERRORS = KEYED_ERRORS | documented_errors(404)


async def stored_response(response_id: str) -> JSONResponse:
    """OpenAI's routes of a stored response (retrieve, delete, cancel, its input items): a 404
    that says why, rather than one that lists the routes."""
    return JSONResponse(error_body(f"no response {response_id!r}: {NOT_STORED}", 404, "response_id", code=None),
                        status_code=404)


for _path, _method, _op in ((RESPONSES_PATH + "/{response_id}", "GET", "retrieve_response"),
                            (RESPONSES_PATH + "/{response_id}", "DELETE", "delete_response"),
                            (RESPONSES_PATH + "/{response_id}/{action}", "GET", "list_response_items"),
                            (RESPONSES_PATH + "/{response_id}/{action}", "POST", "cancel_response")):
    # one route per method, each with its own operation id (one route with several methods shares one)
    app.add_api_route(_path, stored_response, methods=[_method], responses=STORED_ERRORS, operation_id=_op)


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
