"""The ingress's end of the stream channels (``replicas/channel.py`` has the rules): one
long-lived call per replica that carries the middle chunks of this ingress's streams there.

A channel opens when a stream's first chunk names a replica this ingress has none open with
(``watch``); its pieces go to the streams registered by request id (``ReplicaStream.piece``); a
piece for a stream that has ended, or not begun, is dropped (the stream's own call carries every
token it lacks). A channel that ends (idle, its replica gone) is opened again at the next first
chunk from that replica, at most once per ``retry_s`` after one that failed.

Cost: O(1) per piece (a dict lookup and the stream's wake); one task per open channel.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Protocol

from fairway.clock import Clock, MonotonicClock
from fairway.protocol import ChannelCall
from router.calls import own_serve_request_id

logger = logging.getLogger("ray.serve")

#: After a channel failed, how long before that replica's channel is opened again, seconds
CHANNEL_RETRY_S = 5.0


class PieceSink(Protocol):
    def piece(self, offset: int, token_ids: list[int]) -> None: ...


class StreamChannels:
    """This ingress replica's open channels and the streams they feed (module docstring).
    ``open_call``: a ``ChannelCall`` -> the async iterator of its batches (the replica handle's
    ``channel`` method, through the request router that pins it)."""

    def __init__(self, name: str, open_call: Any, retry_s: float = CHANNEL_RETRY_S,
                 clock: Clock | None = None) -> None:
        self.name = name
        self.clock = clock or MonotonicClock()
        self.open_call = open_call
        self.retry_s = retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}
        self._sinks: dict[str, PieceSink] = {}
        self.pieces = 0  # pieces delivered to a stream (tests read it; fairway_stream_tokens_total counts tokens)
        self.dropped = 0  # pieces for no registered stream

    def __len__(self) -> int:
        return len(self._tasks)

    def register(self, request_id: str, sink: PieceSink) -> None:
        self._sinks[request_id] = sink

    def unregister(self, request_id: str, sink: PieceSink) -> None:
        if self._sinks.get(request_id) is sink:
            del self._sinks[request_id]

    def watch(self, replica: str) -> None:
        """Open the channel to ``replica`` unless one is open (or failed within ``retry_s``). In
        a fresh context: the channel's call is no request's (its Serve request id is its own)."""
        if not replica or replica in self._tasks:
            return
        failed = self._failed_at.get(replica)
        if failed is not None and self.clock.now() - failed < self.retry_s:
            return
        loop = asyncio.get_running_loop()
        self._tasks[replica] = loop.create_task(self._run(replica), context=contextvars.Context())

    async def _run(self, replica: str) -> None:
        own_serve_request_id()
        try:
            async for batch in self.open_call(ChannelCall(self.name, replica)):
                sinks = self._sinks
                for rid, offset, ids in batch:
                    sink = sinks.get(rid)
                    if sink is None:
                        self.dropped += 1
                    else:
                        sink.piece(offset, ids)
                        self.pieces += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the streams' own calls carry every token
            self._failed_at[replica] = self.clock.now()
            logger.info("ingress %s: stream channel to %s ended: %s", self.name, replica, e)
        finally:
            del self._tasks[replica]
