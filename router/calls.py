"""A call to a replica as the ingress holds it: its token stream (``ReplicaStream``), the
client it answers (``unless_gone``: the wait ends when the client leaves), and the Ray Serve
request id each of a request's calls goes under (``own_serve_request_id``).

A client that disconnects has its call cancelled at the replica, which aborts the request in its
gate and engine (queue slot and KV blocks freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from ray.serve import context as serve_context

from fairway.policies.classes import ClassesConfig
from fairway.protocol import GenerateCall, TokenChunk
from router.errors import HTTPError, map_error
from router.openai_api import new_id

logger = logging.getLogger("ray.serve")
T = TypeVar("T")


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


class ReplicaStream:
    """One call's token stream from its replica, with error mapping (``map_error``) and the
    router's metrics: TTFT when the first token reaches the client, requests by status, e2e.
    ``holder``: the held queue, told of room at the first token and at the end; ``stats``: the
    router's metrics (None: none); ``classes``: the request classes (their objectives);
    ``channels``: the ingress's stream channels (``router/channels.py``; None: every chunk comes
    on the call), which feed ``piece``.

    With channels, the chunks after the first come from two places, the call and its replica's
    channel, each with its offset in the output; ``rest`` passes each token on once, in order:
    a piece past a gap waits for it, and what the call carries again is dropped."""

    def __init__(self, call: GenerateCall, gen: Any, holder: Any, stats: Any, classes: ClassesConfig,
                 channels: Any = None) -> None:
        self.holder = holder
        self.stats = stats
        self.classes = classes
        self.call = call
        self.gen = gen
        self.ttft_s = 0.0
        self.lane = ""
        self.replica = ""
        self.done = False
        self._early: TokenChunk | None = None  # a first chunk read by ``accepted``
        self.held_s = 0.0  # how long the router held it before a gate took it
        self.channels = channels
        self._emitted = 0  # output tokens passed on
        self._box: deque[Any] = deque()  # channel pieces (offset, ids), the call's chunks and its failure
        self._waiter: asyncio.Future[None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._pump_stopped = False
        self._by_channel = 0  # of ``_emitted``: the tokens that came on the channel
        if channels is not None:
            channels.register(call.request_id, self)

    async def _next(self) -> TokenChunk:
        try:
            return await self.gen.__anext__()
        except StopAsyncIteration:
            self._unregister()
            raise HTTPError(503, "replica ended the stream without finishing the request", 1.0,
                            "engine_failed") from None
        except HTTPError:
            self._unregister()
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes an HTTP status
            self._unregister()  # a refused call is not closed (nothing runs): it gets no more pieces either
            raise map_error(e) from e

    def _unregister(self) -> None:
        if self.channels is not None:
            self.channels.unregister(self.call.request_id, self)

    async def first(self, sent: bool = True) -> TokenChunk:
        """The first chunk. Its TTFT is taken now when the answer is a whole one (``sent``), else
        by ``sent_first`` once the first event has been written (what a streaming client waits
        for)."""
        c, self._early = self._early or await self._next(), None
        self.holder.room()  # a prefill ended at its replica: that queue moved
        self.lane = c.lane
        self.replica = c.replica
        self._emitted = c.offset + len(c.token_ids)
        if self.channels is not None and not c.finished:
            self.channels.watch(c.replica)
        if self.stats is not None:
            self.stats.observe_queue_wait(c.lane, c.queue_wait_s, replica=c.replica)
            expected = self.call.expected_ttft_s
            if expected > 0.0 and c.ttft_s > 0.0 and not self.held_s:  # held: routed after its clock started
                self.stats.observe_ttft_model(self.call.routing_reason, c.ttft_s / expected)
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
        st = self.stats
        if st is not None:
            st.observe_ttft(self.lane, self.ttft_s, replica=self.replica)
            name = self.call.priority_class
            if name:
                st.observe_class_ttft(name, self.ttft_s, self.classes.spec(name).objective_s, self.lane)

    async def rest(self) -> AsyncIterator[TokenChunk]:
        if self.done:
            return
        if self.channels is not None:
            async for c in self._merged():
                yield c
            return
        try:
            while True:
                c = await self._next()
                self._emitted += len(c.token_ids)
                yield c
                if c.finished:
                    self._finish("ok")
                    return
        except HTTPError:
            self._finish("error")
            raise

    def piece(self, offset: int, token_ids: list[int]) -> None:
        """A channel's piece of this stream's output. O(1)."""
        if not self.done:
            self._box.append((offset, token_ids))
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _pump_call(self) -> None:
        """The call's chunks into the box, to its last chunk or its failure."""
        try:
            while True:
                c = await self._next()
                self._box.append(c)
                self._wake()
                if c.finished:
                    return
        except HTTPError as e:
            self._box.append(e)
            self._wake()
        except asyncio.CancelledError:
            if not self._pump_stopped:  # the call was cancelled under it, not by this stream: never a hang
                self._box.append(HTTPError(503, "the replica's stream was cancelled", 1.0, "engine_failed"))
                self._wake()
            raise

    def _stop_pump(self) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump_stopped = True
            self._pump.cancel()

    async def _merged(self) -> AsyncIterator[TokenChunk]:
        """``rest`` with a channel: the call's chunks and the channel's pieces, each token once,
        in order (the class docstring). O(1) per chunk, plus the pieces held past a gap."""
        loop = asyncio.get_running_loop()
        self._pump = asyncio.ensure_future(self._pump_call())
        ahead: dict[int, list[int]] = {}  # pieces past a gap, by offset
        box = self._box
        try:
            while True:
                while not box:
                    self._waiter = loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                item = box.popleft()
                if isinstance(item, HTTPError):
                    self._finish("error")
                    raise item
                if isinstance(item, TokenChunk):
                    skip = self._emitted - item.offset
                    if skip > 0:
                        item = dataclasses.replace(item, token_ids=item.token_ids[skip:], offset=self._emitted)
                    self._emitted = item.offset + len(item.token_ids)
                    if item.finished:
                        yield item
                        self._finish("ok")
                        return
                    if item.token_ids:
                        yield item
                    if not ahead or (nxt := ahead.pop(self._emitted, None)) is None:
                        continue
                    item = (self._emitted, nxt)
                offset, ids = item
                if offset > self._emitted:
                    ahead[offset] = ids
                    continue
                while True:  # this piece, then any held piece it reaches
                    skip = self._emitted - offset
                    if skip < len(ids):
                        ids = ids[skip:] if skip else ids
                        self._emitted += len(ids)
                        self._by_channel += len(ids)
                        yield TokenChunk(token_ids=ids, offset=self._emitted - len(ids), lane=self.lane,
                                         replica=self.replica, completion_tokens=self._emitted)
                    if not ahead or (nxt := ahead.pop(self._emitted, None)) is None:
                        break
                    offset, ids = self._emitted, nxt
        finally:
            self._stop_pump()

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
        self._stop_pump()
        try:
            self.gen.cancel()
        except Exception as e:  # noqa: BLE001 - the replica may already be gone
            logger.debug("ingress: cancel of %s failed: %s", self.call.request_id, e)

    def _finish(self, status: str) -> None:
        if self.done:
            return
        self.done = True
        if self.channels is not None:
            self._unregister()
            self._box.clear()
        self.holder.room()
        st = self.stats
        if st is not None:
            st.inc_stream_tokens(self._emitted - self._by_channel, self._by_channel)
            st.inc_requests(self.lane, status)
            if status == "ok":
                st.observe_e2e(self.lane, time.time() - self.call.waited_from,
                               replica=self.replica)


def own_serve_request_id() -> None:
    """Give the handle calls this task makes from now on a Serve internal request id of their
    own. Why: Ray Serve's request router keeps pending requests by that id, which a handle call
    takes from the request context, so every call made while serving one HTTP request shares it;
    two such calls waiting for a replica at once leave one never assigned, and Ray retries its
    routing forever (a request's n choices sent together hung so, the ingress at full CPU). The
    context is the task's own copy, so its caller's is untouched. O(1)."""
    ctx = serve_context._serve_request_context.get() or serve_context._RequestContext()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=new_id("fairway")))
