"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat path.

Newer agent SDKs (OpenAI's Agents SDK, Codex-style clients) speak the Responses API by default.
A Responses request is a chat in other clothes: ``instructions`` and ``input`` items are the
messages (a past ``function_call`` item an assistant's tool call, a ``function_call_output`` the
tool's answer), ``tools`` are flat function definitions, ``text.format`` is the chat's
``response_format``, ``max_output_tokens`` its ``max_completion_tokens``. ``to_chat`` maps one
onto a ``ChatCompletionRequest`` (as vLLM's own server maps it onto its chat machinery), so the
chat template, the tool-call handling, the stops and the routing are the chat path's, unchanged;
``whole_output`` and ``ResponseEvents`` write the answer back as a Response object or as its
typed stream events.

Nothing is kept between requests: this server stores no response. ``store: true``,
``previous_response_id``, ``conversation`` and ``background`` need a stored response and are a
400 that says so (send the history as ``input``), as are the built-in tools (web search, file
search, ...), non-text inputs, ``reasoning`` settings, ``include`` other than the output
text's log probabilities; every other field is honoured or is a 400 naming it (unknown fields
too). ``truncation: auto`` drops the input's oldest items until the prompt and
``max_output_tokens`` (one token without it) fit the context, as OpenAI's does: the instructions
stay, and so does the last item; a cut never leaves a tool's answer without the call before it
(``Tokenizer.encode_chat_fitting``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from router.openai_api import (
    FUNCTION_NAME,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    REFUSED,
    ChatCompletionRequest,
    _refuse,
    _Sampling,
    _Text,
    at_most,
    at_most_items,
    error_text,
    new_id,
    now_s,
)

#: Documented Responses parameters this server cannot honour: (accepted values, why not otherwise).
RESPONSES_REFUSED: dict[str, tuple[Any, str]] = {
    "store": (lambda v: not v, "responses are not stored by this server; send store: false (or omit it) and send "
                               "the conversation so far as input"),
    "previous_response_id": (lambda v: not v, "responses are not stored by this server, so none can be continued; "
                                              "send the conversation so far as input"),
    "conversation": (lambda v: not v, "conversations are not stored by this server; send the conversation so far "
                                      "as input"),
    "background": (lambda v: not v, "background responses need a stored response, which this server does not keep"),
    "reasoning": (lambda v: not v, "this model does not reason; reasoning settings are not supported"),
    "prompt": (lambda v: not v, "stored prompt templates are not supported; send instructions and input"),
    "service_tier": REFUSED["service_tier"],
    "prompt_cache_retention": REFUSED["prompt_cache_retention"],
}

#: The one ``include`` value served: the output text's log probabilities (the engine's, as on chat)
OUTPUT_LOGPROBS = "message.output_text.logprobs"
#: The input item types this server takes (others, such as images, files or built-in tool calls,
#: are a 400 naming them).
INPUT_TYPES = ("message", "function_call", "function_call_output")
#: Content part types of an input message (``output_text`` and ``refusal`` in an assistant turn
#: sent back as history); images, files and audio are a 400.
TEXT_PARTS = ("input_text", "output_text", "text")


class ContentPart(_Text):
    """A text part of an input message. An assistant's ``output_text`` sent back as history keeps
    its ``annotations`` and ``logprobs`` (accepted, not read)."""

    model_config = ConfigDict(extra="forbid")

    type: str
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in TEXT_PARTS:
            raise ValueError(f"content parts of type {v!r} are not supported; only text ({', '.join(TEXT_PARTS)})")
        return v


def joined(content: str | list[ContentPart]) -> str:
    """An item's text: a string as it is, or its parts' texts joined. O(text)."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Text):
    """A message: the user's, the system's or developer's, or an earlier assistant answer."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined(self.content)


class FunctionCallItem(_Text):
    """A tool call the model made earlier (an answer's ``function_call`` item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Text):
    """The answer of the tool call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined(self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class FunctionTool(_Text):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Text):
    type: Literal["function"]
    name: str


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool) -> bool:
        if v:
            raise ValueError("stream obfuscation is not supported; send include_obfuscation: false (or omit it)")
        return v


_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def telling(e: ValidationError) -> dict[str, Any]:
    """The error of ``e`` to tell the client: a rule's own message (a value error) before a
    type mismatch, which in a union (text or parts) only says that one branch did not fit."""
    errors = e.errors()
    return next((x for x in errors if x.get("type") == "value_error"), errors[0])


def _typed_items(v: Any) -> Any:
    """``input``'s items, each with its type (a message may omit it, as OpenAI allows) and
    validated here, so that a bad item's 400 names the item and what is wrong with it rather
    than every branch of text-or-items. O(items)."""
    if not isinstance(v, list):
        return v
    if not v:
        raise ValueError("input must not be an empty list")
    out = []
    for i, item in enumerate(v):
        if isinstance(item, dict):
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in INPUT_TYPES:
                raise ValueError(f"item {i}: input items of type {kind!r} are not supported; send "
                                 f"{', '.join(INPUT_TYPES)} items")
            item = {**item, "type": kind}
        out.append(item)
    try:
        return _ITEMS.validate_python(out)
    except ValidationError as e:
        first = telling(e)
        loc = [str(x) for x in first.get("loc", ())]
        where = f"item {loc[0]}" + (f" ({'.'.join(loc[2:])})" if len(loc) > 2 else "")
        raise ValueError(f"{where}: {error_text(first)}") from None


class ResponsesRequest(_Sampling):
    """``POST /v1/responses``: ``input`` (text, or message and function-call items) after
    ``instructions``; answered as one Response object, or with ``stream: true`` as its events.
    The sampling fields, end-user keys and class are the chat's (``_Sampling``)."""

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, description="bounds built-in tool calls, of which there are "
                                       "none here")
    text: dict[str, Any] | None = Field(None, description="{\"format\": {\"type\": \"text\"}} (the default), "
                                        "\"json_object\", or \"json_schema\" with name and schema")
    metadata: dict[str, str] | None = Field(None, description="up to 16 pairs, returned with the response")
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = Field(None, description="extra output: only message.output_text.logprobs (each "
                                      "output token's log probability, on engines that sample from logits)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with include "
                                     "message.output_text.logprobs: this many most likely tokens at each position")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="auto: an input over the context "
                                                         "loses its oldest items until it fits (instructions kept); "
                                                         "disabled (the default): it is a 400")
    prompt: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return _typed_items(at_most_items(v, "input items"))

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        """A built-in tool (web search, file search, ...) gets a 400 that names its type."""
        for i, t in enumerate(at_most(v, MAX_TOOLS, "tools") if isinstance(v, list) else []):
            if isinstance(t, dict) and t.get("type") != "function":
                raise ValueError(f"tool {i}: tools of type {t.get('type')!r} are not supported (no built-in tools "
                                 "run here); send function tools")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        other = sorted(set(v or ()) - {OUTPUT_LOGPROBS})
        if other:
            raise ValueError(f"{other} not available here (no reasoning, built-in tool results or images are "
                             f"kept); only {OUTPUT_LOGPROBS!r}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_include(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and OUTPUT_LOGPROBS not in (info.data.get("include") or ()):
            raise ValueError(f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}]")
        return v

    def logprobs(self) -> bool:
        """Whether the answer lists its tokens' log probabilities (``include``)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters")
        return v

    @field_validator(*RESPONSES_REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(v, info, RESPONSES_REFUSED)

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat's ``response_format`` (None: free text); a ValueError
        names what is malformed."""
        if not self.text:
            return None
        unknown = set(self.text) - {"format", "verbosity"}
        if unknown:
            raise ValueError(f"text: unknown field(s) {sorted(unknown)}")
        if self.text.get("verbosity") not in (None, "medium"):
            raise ValueError("text.verbosity: output verbosity control is not supported")
        fmt = self.text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise ValueError("text.format must be an object with a type")
        kind = fmt.get("type")
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind == "json_schema":
            if not isinstance(fmt.get("name"), str) or not fmt["name"]:
                raise ValueError("text.format json_schema needs a name")
            return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt.get("schema", {})}}
        raise ValueError(f"text.format type {kind!r} is not supported; use text, json_object or json_schema")

    def fixed_messages(self) -> int:
        """How many of ``messages()`` ``truncation: auto`` never drops: the instructions' system
        message, when there are instructions."""
        return 1 if self.instructions else 0

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: ``instructions`` as the system message, then the input items in
        order; consecutive past function calls are one assistant message's ``tool_calls``, each
        tool answer a ``tool`` message. O(items)."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out


class MappingError(ValueError):
    """A Responses request that has no chat to stand for: ``param`` the field at fault, in the
    Responses request's words."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


#: The chat fields an error names, in the Responses request's words
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format"}
#: The parameters an engine's refusal of a call names, in the Responses request's words
AS_RESPONSES_PARAM = {"logprobs": "include", "response_format": "text", "max_tokens": "max_output_tokens"}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` stands for: the fields both share (``_Sampling``) as they are,
    the others mapped (module docstring). A ``MappingError`` for a malformed ``text``, or when
    the two disagree in a way only the chat rules see (e.g. a tool_choice with a JSON text
    format, a named function not in tools). O(input)."""
    body: dict[str, Any] = {name: getattr(req, name) for name in _Sampling.model_fields}
    body |= {"messages": req.messages(), "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.logprobs():
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    try:
        body["response_format"] = req.response_format()
    except ValueError as e:
        raise MappingError("text", str(e)) from None
    if req.tools:  # an empty list is the Responses API's default (none), which the chat route refuses
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = telling(e)
        field = str((first.get("loc") or ("input",))[0])
        raise MappingError(CHAT_TO_RESPONSES.get(field, field), error_text(first)) from None


def tools_echo(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as a Response object lists them."""
    return [t.model_dump() for t in req.tools or []]


def tool_choice_echo(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return choice.model_dump()
    return choice or ("auto" if req.tools else "none")


def head(req: ResponsesRequest, rid: str) -> dict[str, Any]:
    """A Response object's fields that the request decides (status, output, usage and error come
    with the answer)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": now_s(), "status": "in_progress", "background": False,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls, "model": req.model,
        "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": None, "service_tier": "default", "store": False, "temperature": req.temperature,
        "text": {"format": fmt}, "tool_choice": tool_choice_echo(req), "tools": tools_echo(req),
        "top_p": req.top_p, "top_logprobs": req.top_logprobs or 0, "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat answer's usage in the Responses API's names."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def finished(reason: str) -> tuple[str, dict[str, Any] | None]:
    """A chat finish reason as the Response's status and ``incomplete_details``."""
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _text_item(text: str, status: str = "completed", logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg", "_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function", {})
    return {"type": "function_call", "id": new_id("fc", "_"), "call_id": call.get("id", ""), "name": fn.get("name", ""),
            "arguments": fn.get("arguments", ""), "status": status}


def whole_output(message: dict[str, Any], logprobs: list[Any] | None = None) -> list[dict[str, Any]]:
    """A chat answer's message as a Response's output items: its text (when it has any, or has no
    calls) as one message item, with ``logprobs`` (the chat's per-token entries, the same shape)
    on its text part, then one ``function_call`` item per tool call."""
    calls = message.get("tool_calls") or []
    text = message.get("content")
    out = [_text_item(text or "", logprobs=logprobs)] if text or not calls else []
    return out + [_call_item(c) for c in calls]


class ResponseEvents:
    """A streamed answer as the Responses API's typed events, from the chat path's deltas.

    Why: the chat path (stops, tool-call parsing, detokenization) yields OpenAI chat deltas; a
    Responses client reads output items opened, filled and closed, each event numbered. A text
    delta opens the message item and its one ``output_text`` part on its first piece; a tool call
    delta with an id opens a ``function_call`` item, and its later pieces are argument deltas;
    ``finish`` closes what is open and sends the whole Response. O(1) per delta but the final
    object, O(output)."""

    def __init__(self, head_fields: dict[str, Any]) -> None:
        self.head = head_fields
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items, as each will be when done
        self.text_at: int | None = None  # the open message item's index
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's index
        self.open: list[int] = []  # the items not yet done, in order
        self.pending_lps: list[Any] = []  # log probabilities not yet sent (their text held back)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, **fields: Any) -> dict[str, Any]:
        return {**self.head, "output": [dict(i) for i in self.output], **fields}

    def start(self) -> list[dict[str, Any]]:
        """The first events: the response created, and in progress."""
        r = self._response()
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def delta(self, delta: dict[str, Any], logprobs: list[Any] | None = None) -> list[dict[str, Any]]:
        """The events for one chat delta (``content`` text, ``tool_calls`` pieces); ``logprobs``:
        its tokens' entries (with ``include``), sent with the next text delta (a piece whose text
        is held back has none) and listed on the text part."""
        events = []
        if logprobs:
            self.pending_lps.extend(logprobs)
        text = delta.get("content")
        if text:
            if self.text_at is None:
                events += self._open_text()
            item = self.output[self.text_at]
            part = item["content"][0]
            part["text"] += text
            lps, self.pending_lps = self.pending_lps, []
            part["logprobs"].extend(lps)
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.text_at,
                                      content_index=0, delta=text, logprobs=lps))
        for piece in delta.get("tool_calls") or []:
            at = self.calls.get(piece.get("index", 0))
            args = (piece.get("function") or {}).get("arguments", "")
            if at is None:
                at = self.calls[piece.get("index", 0)] = len(self.output)
                item = _call_item({**piece, "function": {**(piece.get("function") or {}), "arguments": ""}},
                                  "in_progress")
                self.output.append(item)
                self.open.append(at)
                events.append(self._event("response.output_item.added", output_index=at, item=dict(item)))
            item = self.output[at]
            if args:
                item["arguments"] += args
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=at, delta=args))
        return events

    def _open_text(self) -> list[dict[str, Any]]:
        """Open the message item and its one text part (``text_at``): their added events."""
        at = self.text_at = len(self.output)
        item = _text_item("", "in_progress")
        self.output.append(item)
        self.open.append(at)
        return [self._event("response.output_item.added", output_index=at, item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self, at: int) -> list[dict[str, Any]]:
        item = self.output[at]
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"].extend(self.pending_lps)
            self.pending_lps = []
            return [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"], logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                part=dict(part)),
                    self._event("response.output_item.done", output_index=at, item=item)]
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=at, item=item)]

    def finish(self, reason: str, answer_usage: dict[str, Any], **extra: Any) -> list[dict[str, Any]]:
        """The last events: every open item done, then the whole Response (``response.completed``,
        or ``response.incomplete`` for an answer cut at ``max_output_tokens``)."""
        events = [] if self.output else self._open_text()  # an empty answer is still one (empty) message
        for at in self.open:
            events += self._close(at)
        self.open = []
        status, details = finished(reason)
        r = self._response(status=status, incomplete_details=details, usage=usage(answer_usage), **extra)
        return events + [self._event(f"response.{status}", response=r)]

    def failed(self, message: str, code: str | None) -> list[dict[str, Any]]:
        """A failure after the stream started: the Response failed, with the error."""
        r = self._response(status="failed", error={"code": code or "server_error", "message": message})
        return [self._event("response.failed", response=r)]
