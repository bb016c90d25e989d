"""The OpenAI-compatible request and response shapes the ingress accepts and returns.

Pydantic at the boundary (docs/design.md, Typed config at the boundary): a malformed body is
refused with HTTP 400 and an OpenAI-style error object naming the field, before anything is
queued. Extensions beyond
OpenAI's schema follow vLLM's names where vLLM has them (``ignore_eos``, ``return_token_ids``,
``cache_salt``); Fairway's own figures travel in a ``fairway`` object next to ``usage``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    user: str | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (a one-element
    list of either is accepted too, as OpenAI's batch form with one prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if any(t < 0 for t in v):
                raise ValueError("token ids must be >= 0")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; the tokenizer's chat template renders ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _not_blank(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text() for m in v):
            raise ValueError("messages must contain some text")
        return v


#: ``error_body``'s default: the code that goes with the status (``CODES``).
BY_STATUS = "by status"
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_error", 431: "invalid_request_error", 503: "service_unavailable",
         504: "timeout_error"}
CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "queue_full"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = BY_STATUS) -> dict[str, Any]:
    """OpenAI's error object (``code``: the status's usual code unless given, None for none)."""
    if code == BY_STATUS:
        code = CODES.get(status)
    return {"error": {"message": message, "type": KINDS.get(status, "server_error"), "param": param, "code": code}}


async def send_error(send: Any, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = (),
                     code: str | None = BY_STATUS) -> None:
    """Answer an ASGI request with ``error_body`` (for middleware that refuses before the app
    runs)."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
