"""The replica's end of the stream channels: one per ingress replica, carrying the middle chunks
of every stream that ingress sent here, merged per flush.

Why: every item a Serve stream carries costs about 0.14 ms of CPU over the two processes (a gRPC
message, pickling, a wake of its reader; docs/benchmarks.md, 6) whatever its size, and a stream
merged over ``stream_interval_s`` is still one item per stream per interval. A channel carries
the chunks of all of an ingress's streams on this replica in one item per flush.

Rules:
- The ingress opens a channel with a ``ChannelCall`` (a streaming call its request router pins
  to this replica; ``FairwayReplica.channel``); it yields lists of ``ChannelPiece``s.
- A stream's first chunk (TTFT, its lane and timings), its last (finish, usage) and every chunk
  while no channel of its ingress is open go on its own call (``relay``); the chunks between go on
  the channel. The call stays the request: routing, errors and cancellation are unchanged.
- The call is self-sufficient: a chunk it carries after pieces went on the channel carries every
  token since the first of those pieces (``TokenChunk.offset`` says where it starts), so a lost
  channel costs smoothness, never a token; the ingress drops what it already has.
- Flush: the first piece after a quiet spell leaves on the next turn of the event loop (with the
  other streams an engine step woke in the same turn); later ones at most every ``min_gap_s``.
- A channel ends after ``idle_s`` with no stream using it and no piece, so it never holds a
  stopping replica (Serve waits for its ongoing calls); the ingress opens it again when it next
  streams from here. A second open by the same ingress ends the first.

Cost: O(1) per piece (a list append; one future wake per flush); one Ray item per flush per
ingress instead of one per stream per interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fairway.clock import Clock
from fairway.protocol import ChannelPiece, GenerateCall, TokenChunk

#: The shortest gap between two flushes of one channel, seconds: up to 100 items a second, each
#: chunk held 10 ms at most (a stream's own interval is 50 ms)
CHANNEL_MIN_GAP_S = 0.01
#: A channel with no stream and no piece for this long ends, seconds
CHANNEL_IDLE_S = 1.0


class _Outbox:
    """One open channel's pieces since its last flush and the streams that use it."""

    __slots__ = ("pieces", "waiter", "users", "closed", "sent_at")

    def __init__(self) -> None:
        self.pieces: list[ChannelPiece] = []
        self.waiter: asyncio.Future[None] | None = None
        self.users = 0
        self.closed = False
        self.sent_at = float("-inf")

    def put(self, piece: ChannelPiece) -> None:
        self.pieces.append(piece)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class Channels:
    """This replica's open channels, by ingress (module docstring)."""

    def __init__(self, clock: Clock, min_gap_s: float = CHANNEL_MIN_GAP_S, idle_s: float = CHANNEL_IDLE_S) -> None:
        self.clock = clock
        self.min_gap_s = min_gap_s
        self.idle_s = idle_s
        self._open: dict[str, _Outbox] = {}
        self.flushes = 0  # items sent on every channel (tests read it)

    def __len__(self) -> int:
        return len(self._open)

    async def serve(self, ingress: str) -> AsyncIterator[list[ChannelPiece]]:
        """The channel to ``ingress``: its pieces, one list per flush, until it is idle for
        ``idle_s``, another open replaces it, or its caller goes away."""
        old = self._open.get(ingress)
        if old is not None:
            old.close()
        box = self._open[ingress] = _Outbox()
        loop = asyncio.get_running_loop()
        try:
            while not box.closed:
                if not box.pieces:
                    box.waiter = loop.create_future()
                    try:
                        await asyncio.wait_for(box.waiter, self.idle_s)
                    except TimeoutError:
                        if box.users == 0 and not box.pieces:
                            return
                        continue
                    finally:
                        box.waiter = None
                    if box.closed or not box.pieces:
                        continue
                wait = box.sent_at + self.min_gap_s - self.clock.now()
                if wait > 0:
                    await asyncio.sleep(wait)
                batch, box.pieces = box.pieces, []
                box.sent_at = self.clock.now()
                self.flushes += 1
                yield batch
        finally:
            box.closed = True
            if self._open.get(ingress) is box:
                del self._open[ingress]

    async def relay(self, call: GenerateCall, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """``chunks`` (a call's stream) with their offsets, its middle chunks put on the channel
        of ``call.channel`` while one is open (module docstring). A call that asks for log
        probabilities keeps every chunk (they stay beside their tokens)."""
        ingress = call.channel if call.logprobs is None and call.prompt_logprobs is None else ""
        offset, first = 0, True
        since: list[int] | None = None  # the tokens sent on a channel since the call's last chunk
        since_at = 0
        using: _Outbox | None = None
        try:
            async for c in chunks:
                if c.accepted:
                    yield c
                    continue
                n = len(c.token_ids)
                box = None if (first or c.finished or not ingress) else self._open.get(ingress)
                if box is not None and not box.closed:
                    if box is not using:
                        if using is not None:
                            using.users -= 1
                        box.users += 1
                        using = box
                    if since is None:
                        since, since_at = [], offset
                    since.extend(c.token_ids)
                    box.put((call.request_id, offset, c.token_ids))
                else:
                    if since is not None:
                        c = replace(c, token_ids=since + c.token_ids, offset=since_at)
                        since = None
                    else:
                        c.offset = offset
                    yield c
                offset += n
                first = False
        finally:
            if using is not None:
                using.users -= 1
            await _close(chunks)


async def _close(chunks: AsyncIterator[TokenChunk]) -> None:
    """Close a source generator now (the gate then releases its request), not when it is collected."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
