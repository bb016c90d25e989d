"""One streamed completion against an OpenAI-compatible server, timed; and model discovery.

The server contract (our ingress implements it):
- ``POST {url}/v1/completions`` with ``stream: true`` answers Server-Sent Events: lines
  ``data: {json}``. Content chunks carry ``choices[0].text`` and optionally
  ``choices[0].token_ids``; a final chunk with ``"choices": []`` carries ``usage``
  (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) and the
  extension ``fairway`` (``lane``, ``replica``, ``queue_wait_s``, ``ttft_s``, ``policy``); then
  ``data: [DONE]``.
- A chunk is a token event when its text or its token ids are non-empty.
- Errors: a non-2xx status with ``{"error": {"message", "type", "code"}}``; 429 and 503 may carry
  ``Retry-After`` (seconds).

Timing, all on the injected clock: TTFT = first token event - send; ITL = gaps between
consecutive token events; E2E = end of stream - send. With retries, the send is the first
attempt's (what the user waits). Every call is bounded by ``timeout_s`` in total; running past it
gives status ``"timeout"``.

A request written onto a pooled keep-alive connection that the server closes before any byte of
an answer is sent again, once, on another connection (``resent``): the request can have crossed
the server's close of an idle connection, which no server can prevent. HTTP clients do the same
for a request on a reused connection (Go's net/http, and the OpenAI SDK, which retries every
connection error). A connection the client opened for the request that closes unanswered is not
resent: that is the server's failure, and the ledger counts it lost. Knowing whether the
connection was reused needs the session's ``reuse_tracing()``; without it nothing is resent.

A client may hang up on purpose (``hang_up_after_s``: close the connection that many seconds after
sending, whatever state the request is in; ``hang_up_after_events``: close it after that many
token events): status ``"disconnected"``, unless the answer was complete first.
"""

from __future__ import annotations

import asyncio
import json
from array import array
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fairway.clock import Clock

RETRYABLE = (429, 503, 504)
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class StreamResult:
    """What one request produced. ``status`` is the HTTP status as text (``"200"``, ``"429"``)
    or ``"timeout"`` / ``"connection"`` / ``"stream"`` (a 2xx stream that broke or carried an
    error) / ``"disconnected"`` (the client hung up on purpose). ``ok`` iff the stream ended with
    ``[DONE]`` or a final usage chunk. ``started``: a 2xx status line came (the stream began).
    ``error_event``: the stream ended with the server's error event (a clear failure, not a cut).
    ``resent``: sent a second time after its reused connection closed unanswered (module docstring).
    Invariants when ``ok``: ``ttft_s`` is set unless no token came, ``len(itl_s)`` is one less
    than the number of token events, ``e2e_s >= ttft_s``."""

    status: str
    ok: bool = False
    ttft_s: float | None = None
    itl_s: array = field(default_factory=lambda: array("d"))  # 8 bytes per gap
    e2e_s: float | None = None
    n_events: int = 0
    output_ids: list[int] | None = None  # None if any token event lacked token ids
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    lane: str = ""
    replica: str = ""
    policy: str | None = None
    queue_wait_s: float | None = None
    server_ttft_s: float | None = None
    retries: int = 0
    error: str = ""
    started: bool = False
    error_event: bool = False
    resent: bool = False

    @property
    def rejected(self) -> bool:
        """Answered with a non-2xx HTTP status (the server refused or failed it)."""
        return self.status.isdigit() and not self.status.startswith("2")


class ServerError(ValueError):
    """The server cannot be used: unreachable, or it does not list a model when asked."""


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", "")) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _retry_after(headers: Any) -> float:
    try:
        return max(0.0, float(headers.get("Retry-After", DEFAULT_RETRY_AFTER_S)))
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S


class _HangUp(Exception):
    """The client closes the connection on purpose (``hang_up_after_events``)."""


class _SSEAccumulator:
    """Folds parsed SSE payloads into a ``StreamResult``; O(1) per chunk plus its token ids."""

    def __init__(self, res: StreamResult, clock: Clock, sent: float) -> None:
        self.res = res
        self.clock = clock
        self.sent = sent
        self.last_event: float | None = None
        self.done = False
        self.saw_usage = False
        self.ids: list[int] | None = []

    def line(self, raw: bytes) -> None:
        text = raw.strip()
        if not text.startswith(b"data:"):
            return  # blank separators, comments (": ping"), event names
        data = text[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            raise _StreamError(str(err.get("message", err)) if isinstance(err, dict) else str(err))
        choices = chunk.get("choices") or []
        if choices:
            self._content(choices[0])
        if chunk.get("usage"):
            self._usage(chunk["usage"], chunk.get("fairway") or {})

    def _content(self, choice: dict[str, Any]) -> None:
        text = choice.get("text") or ""
        ids = choice.get("token_ids") or []
        if not text and not ids:
            return
        now = self.clock.now()
        res = self.res
        if self.last_event is None:
            res.ttft_s = now - self.sent
        else:
            res.itl_s.append(now - self.last_event)
        self.last_event = now
        res.n_events += 1
        if self.ids is not None:
            if ids:
                self.ids.extend(int(i) for i in ids)
            else:
                self.ids = None  # this server does not return ids: fall back to hash-derived

    def _usage(self, usage: dict[str, Any], fw: dict[str, Any]) -> None:
        res = self.res
        self.saw_usage = True
        res.prompt_tokens = usage.get("prompt_tokens")
        res.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")
        res.lane = str(fw.get("lane") or "")
        res.replica = str(fw.get("replica") or "")
        res.policy = fw.get("policy")
        res.queue_wait_s = fw.get("queue_wait_s")
        res.server_ttft_s = fw.get("ttft_s")

    def finish(self) -> None:
        res = self.res
        res.ok = self.done or self.saw_usage
        if not res.ok:
            res.status, res.error = "stream", "stream ended without [DONE]"
            return
        res.e2e_s = self.clock.now() - self.sent
        res.output_ids = self.ids if self.ids else None


class _StreamError(Exception):
    pass


def reuse_tracing() -> aiohttp.TraceConfig:
    """A trace config for ``ClientSession(trace_configs=[...])`` that marks, in each request's
    ``trace_request_ctx`` dict, whether its connection came from the pool (``"reused"``)."""

    async def reused(session: Any, ctx: Any, params: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["reused"] = True

    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(reused)
    return tc


async def _attempt(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any], res: StreamResult, clock: Clock, sent: float,
    hang_up_after_events: int | None = None,
) -> float | None:
    """One POST, sent again once if its reused connection closed before any answer (module
    docstring); fills ``res``. Returns the Retry-After delay when the answer is retryable."""
    trace: dict[str, bool] = {}
    try:
        return await _post(http, url, payload, res, clock, sent, hang_up_after_events, trace)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        if not trace.get("reused") or res.started or res.resent:
            raise
    res.resent = True
    return await _post(http, url, payload, res, clock, sent, hang_up_after_events, {})


async def _post(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any], res: StreamResult, clock: Clock, sent: float,
    hang_up_after_events: int | None, trace: dict[str, bool],
) -> float | None:
    async with http.post(url, json=payload, trace_request_ctx=trace) as resp:
        if resp.status // 100 != 2:
            res.status, res.error = str(resp.status), _error_message(await resp.read())
            return _retry_after(resp.headers) if resp.status in RETRYABLE else None
        res.status = str(resp.status)
        res.started = True
        acc = _SSEAccumulator(res, clock, sent)
        buf = b""
        try:
            async for piece in resp.content.iter_any():
                buf += piece
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    acc.line(raw)
                if acc.done:
                    break
                if hang_up_after_events is not None and res.n_events >= hang_up_after_events:
                    raise _HangUp
            if buf and not acc.done:
                acc.line(buf)
        except _StreamError as e:
            res.status, res.error, res.error_event = "stream", str(e) or "error event", True
            return None
        except ValueError as e:
            res.status, res.error = "stream", str(e) or type(e).__name__
            return None
        except asyncio.CancelledError:
            resp.close()  # a hang-up or timeout mid-stream: drop the connection, never reuse it
            raise
        except _HangUp:
            resp.close()  # drop the connection, as a client that goes away does
            res.status, res.error = "disconnected", f"client hung up after {res.n_events} token events"
            return None
        acc.finish()
        return None


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    *,
    clock: Clock,
    timeout_s: float,
    retries: int = 0,
    hang_up_after_s: float | None = None,
    hang_up_after_events: int | None = None,
) -> StreamResult:
    """POST ``payload`` to ``{url}/v1/completions`` and read the stream (see the module
    docstring). Retries 429/503 up to ``retries`` times after their Retry-After; the whole call,
    retries included, is bounded by ``timeout_s``. Never raises for a server or network error:
    the outcome is in ``status``."""
    res = StreamResult(status="")
    sent = clock.now()
    endpoint = f"{url.rstrip('/')}/v1/completions"

    async def go() -> None:
        for attempt in range(retries + 1):
            delay = await _attempt(http, endpoint, payload, res, clock, sent, hang_up_after_events)
            if delay is None or attempt == retries:
                return
            res.retries += 1
            await asyncio.sleep(delay)

    hang_up = hang_up_after_s is not None and hang_up_after_s < timeout_s
    try:
        await asyncio.wait_for(go(), hang_up_after_s if hang_up else timeout_s)
    except TimeoutError:
        if hang_up:  # cancelling the read closed the connection: the client went away
            res.ok, res.status, res.error = False, "disconnected", f"client hung up after {hang_up_after_s:g} s"
        else:
            res.ok, res.status, res.error = False, "timeout", f"no complete answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError) as e:
        res.ok, res.status, res.error = False, "connection", str(e) or type(e).__name__
    return res


async def first_model(http: aiohttp.ClientSession, url: str, *, timeout_s: float = 10.0) -> str | None:
    """The first model id ``GET {url}/v1/models`` lists, or None if the server answers without
    one (non-2xx, not JSON, or an empty list). Raises ``ServerError`` when the server cannot be
    reached within ``timeout_s``."""

    async def get() -> Any:
        async with http.get(f"{url.rstrip('/')}/v1/models") as resp:
            if resp.status // 100 != 2:
                return None
            return await resp.json(content_type=None)

    try:
        body = await asyncio.wait_for(get(), timeout_s)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise ServerError(f"cannot reach {url}: {str(e) or type(e).__name__}") from e
    except ValueError:  # a body that is not JSON
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict) or "id" not in data[0]:
        return None
    return str(data[0]["id"])
