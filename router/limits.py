"""Request limits at the ingress, checked before a body is parsed or anything is queued.

Why: the ingress faces every client; a body of unbounded size, a chat of a million messages or a
client that trickles its body in forever must cost a bounded amount of memory and time, and get a
clear answer. What the limits are:

- ``max_body_bytes`` (default 8 MiB: a 32k-token prompt is about 200 kB as token ids, 150 kB as
  text): a larger ``Content-Length`` is refused with 413 without keeping the body: up to
  ``DRAIN_FACTOR`` times the limit it is read and discarded first (a client still sending would
  otherwise see a broken pipe instead of the 413), beyond that the answer goes at once and the
  connection closes; a chunked body is counted as it arrives and refused with 413 at the first
  byte past the limit.
- ``body_timeout_s`` (default 30 s): a body that has not fully arrived by then is refused with 408
  (the slow client's connection is then closed by the HTTP server).
- ``max_messages`` (default 1,024): a chat with more messages gets 400.
- ``max_choices`` (default 64): a request with more choices (its prompts times ``n``, each sent to
  the engines as its own request) gets 400.
- Prompt tokens and ``max_tokens`` are bounded by the model's context length (400), and ``n`` to
  128 (400), where the body is validated (``router/openai_api.py``, ``router/ingress.py``).

- ``max_parse_ms`` (default 100 ms): a body whose JSON would hold the event loop longer than that
  while it is parsed gets 413. The ingress parses every body on its one event loop (FastAPI's
  ``json.loads``, then pydantic), and that cost grows with the number of JSON elements, not bytes:
  8 MiB of text parse in 4-10 ms, 8 MiB of one object's members in 440-480 ms and of empty arrays
  in 420-460 ms, during which every other stream of the replica waits. The estimate
  (``parse_cost_ms``) weighs the body's structural characters by their measured cost
  (``PARSE_US``); it counts the characters inside strings too, so text is overestimated: 8 MiB of
  prose (0.2% colons, 1.5% commas) estimates under 20 ms, but code or JSON pasted as a prompt
  reaches 100 ms at about 4-5 MiB (over a million tokens).
- ``max_receiving_bytes`` (default 1 GiB): the bytes of request bodies this ingress replica holds
  while they arrive, all requests together. Each body is kept whole until it has arrived (it is
  parsed only then), so without a bound one client sending 2,500 bodies of 8 MiB and holding back
  their last bytes would take 20 GB of the replica's memory for the 30 s of ``body_timeout_s``. A
  body that would take the total past the bound is read to its end without being kept and answered
  503 with Retry-After; a body under ``SMALL_BODY_BYTES`` never is (4,096 connections of those hold
  at most 256 MiB).
- ``max_header_bytes`` (default 32 KiB): a request whose header block (names and values) is
  larger gets 431. uvicorn's h11 parser bounds only a header block that arrives in pieces
  (16 KiB); one that arrives in a single read passes it whole, so the limit is checked here too.

``RequestGuard`` is plain ASGI middleware: it checks the headers, reads the request body itself
(up to the limit), then hands it to the application in one message. O(header + body bytes) per
request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.openai_api import BODY_FACTS, BodyFacts, body_has_no_surrogate, send_error

#: A declared body up to this many times the limit is drained before the 413 (module docstring).
DRAIN_FACTOR = 8
#: Microseconds of event-loop time one JSON element costs to parse and validate, by the structural
#: character it comes with: upper bounds over the bodies of one shape each (2 and 8 MiB of token
#: ids, one-token prompts, small lists, empty lists and objects, dict members, messages, tools) on
#: the 2-core development machine, 2026-12-05: an object member (``:``: a key string, its value,
#: the insert) 0.6; an array or object (``[``, ``{``) 0.5; an element of a list (``,``) 0.07.
PARSE_US = ((b":", 0.6), (b"[", 0.5), (b"{", 0.5), (b",", 0.07))
#: The most a byte of a body can add to the estimate: a body of at most ``max_parse_ms`` / this
#: many bytes is never counted, since it cannot pass (166,666 bytes at the default 100 ms).
MAX_US_PER_BYTE = max(us for _, us in PARSE_US)
#: A body smaller than this is never refused for the bodies arriving (``max_receiving_bytes``).
SMALL_BODY_BYTES = 64 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestLimits(BaseModel):
    """The ingress's request limits (the ``limits`` key of the app's args)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    body_timeout_s: float = Field(30.0, gt=0, description="a body not fully received by then gets 408")
    max_messages: int = Field(1024, ge=1, description="chats with more messages get 400")
    max_choices: int = Field(64, ge=1, description="a request's choices (prompts x n), each its own engine request; "
                                                   "more get 400")
    max_header_bytes: int = Field(32 * 1024, ge=1024, description="larger header blocks get 431")
    max_parse_ms: float = Field(100.0, ge=0, description="a body whose JSON is estimated to take longer to parse "
                                                         "gets 413 (0: no bound)")
    max_receiving_bytes: int = Field(1 << 30, ge=0, description="bytes of request bodies held while they arrive, "
                                     "all requests together; a body past it gets 503 (0: no bound)")


def structure_counts(body: bytes) -> dict[bytes, int]:
    """How many of each structural character of ``PARSE_US`` ``body`` holds, strings included
    (module docstring). Why not the exact count outside strings: stripping the strings first (a
    regular expression) took up to 300 ms itself on an 8 MiB body of short strings. O(body
    bytes): four C-speed counts, about 1 ms per MiB."""
    return {ch: body.count(ch) for ch, _ in PARSE_US}


def parse_cost_ms(counts: dict[bytes, int]) -> float:
    """An upper estimate of the event-loop time that parsing a body with these ``counts``
    (``structure_counts``) as JSON takes: each weighted by ``PARSE_US``. O(1)."""
    return sum(counts[ch] * us for ch, us in PARSE_US) / 1000


class RequestGuard:
    """ASGI middleware enforcing the header and body limits (module docstring)."""

    def __init__(self, app: ASGIApp, limits: RequestLimits | Callable[[], RequestLimits] | None = None,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self._limits = limits or RequestLimits()
        self._on_reject = on_reject  # gets the reason of each refusal (the ingress counts them)
        self.receiving = 0  # bytes of the bodies being received now (``max_receiving_bytes``)

    async def _refuse(self, send: Send, status: int, reason: str, message: str,
                      retry_after_s: int | None = None) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)
        await _reply(send, status, message, retry_after_s)

    @property
    def limits(self) -> RequestLimits:
        """The limits now (a callable is asked per request: the ingress's config is known only
        once its replica has started)."""
        return self._limits if isinstance(self._limits, RequestLimits) else self._limits()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers") or ())
        if header_bytes > limits.max_header_bytes:
            await self._refuse(send, 431, "headers_too_large",
                               f"request headers are {header_bytes} bytes; the limit is "
                               f"{limits.max_header_bytes} bytes")
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            if declared <= DRAIN_FACTOR * limit:
                try:
                    await asyncio.wait_for(_drain(receive), limits.body_timeout_s)
                except TimeoutError:
                    pass
            await self._refuse(send, 413, "body_too_large",
                               f"request body is {declared} bytes; the limit is {limit} bytes")
            return
        held = 0  # this body's bytes, counted in ``self.receiving`` while it arrives
        cap = limits.max_receiving_bytes

        def hold(n: int) -> None:
            nonlocal held
            held += n
            self.receiving += n
            if cap and held >= SMALL_BODY_BYTES and self.receiving > cap:
                raise _Busy

        start = asyncio.get_running_loop().time()
        busy = False
        try:
            body = await asyncio.wait_for(_read_body(receive, limit, hold), limits.body_timeout_s)
        except _TooLarge:
            await self._refuse(send, 413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
            return
        except TimeoutError:
            await self._refuse(send, 408, "body_timeout",
                               f"request body not received within {limits.body_timeout_s:g} s")
            return
        except _Busy:
            busy = True  # answered below, outside this block: its traceback holds the parts read so far
        finally:
            self.receiving -= held
        if busy:
            others = self.receiving
            left = limits.body_timeout_s - (asyncio.get_running_loop().time() - start)
            try:  # the rest, read and dropped, so that the client reads the answer
                await asyncio.wait_for(_drain(receive), max(left, 0.0))
            except TimeoutError:
                pass
            await self._refuse(send, 503, "bodies_in_flight",
                               f"this ingress replica is receiving {others} bytes of other request bodies; "
                               f"the limit is {cap} bytes (limits.max_receiving_bytes): retry",
                               retry_after_s=1)
            return
        if body is None:  # the client went away while sending
            return
        if limits.max_parse_ms and len(body) * MAX_US_PER_BYTE > 1000 * limits.max_parse_ms:
            counts = structure_counts(body)
            cost = parse_cost_ms(counts)
            if cost > limits.max_parse_ms:
                await self._refuse(send, 413, "body_too_complex",
                                   f"request body has too many JSON elements to parse here: about {cost:.0f} ms of "
                                   f"work by their count ({counts[b':']} object members, "
                                   f"{counts[b'['] + counts[b'{']} arrays and objects, {counts[b',']} "
                                   f"list elements, strings' own characters included); the limit is "
                                   f"{limits.max_parse_ms:g} ms (limits.max_parse_ms)")
                return
        sent = False
        # for the request models' validators: the body's strings need no surrogate check where its
        # bytes show there is none (O(body) at C speed, where the check walks every list and dict of
        # the parsed body in Python), and a chat's messages are counted before they are read
        checked = BODY_FACTS.set(BodyFacts(no_surrogate=body_has_no_surrogate(body), max_items=limits.max_messages))

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client leaves

        try:
            await self.app(scope, replay, send)
        finally:
            BODY_FACTS.reset(checked)


class _TooLarge(Exception):
    pass


class _Busy(Exception):
    pass


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers") or ():
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int, hold: Callable[[int], None]) -> bytes | None:
    """The whole body, or None if the client disconnected; ``_TooLarge`` past ``limit``. ``hold``
    is told of each part's bytes before it is kept (and may refuse it: ``_Busy``)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise _TooLarge
        hold(len(part))
        chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _drain(receive: Receive) -> None:
    """Read the body to its end (or the client's disconnect), keeping nothing."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            return


async def _reply(send: Send, status: int, message: str, retry_after_s: int | None = None) -> None:
    headers = [(b"connection", b"close")]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send_error(send, status, message, headers=headers)


__all__ = ["RequestGuard", "RequestLimits", "parse_cost_ms", "structure_counts"]
