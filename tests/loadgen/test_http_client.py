"""A request written onto a reused keep-alive connection that the server closes before answering
is sent again once, on another connection; one on a connection opened for it is not (lost).

The server is raw asyncio HTTP/1.1 on 127.0.0.1 (port 0), so it can do what an HTTP framework
will not: read a request and close the connection without a byte of answer. ``drop(conn, n)``
says whether the n-th request (0-based) on the conn-th connection (0-based, in accept order) is
dropped that way; every other request gets a whole stream (one token, usage, ``[DONE]``) and the
connection stays open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from fairway.clock import MonotonicClock
from loadgen.accounting import Ledger, classify, format_report
from loadgen.http_client import reuse_tracing, stream_completion

STREAM = (b'data: {"choices": [{"text": "a", "token_ids": [5]}]}\n\n'
          b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
          b"data: [DONE]\n\n")


class RawServer:
    def __init__(self, drop: Callable[[int, int], bool]) -> None:
        self.drop = drop
        self.connections = 0
        self.log: list[tuple[int, int, str]] = []  # (connection, request on it, "answered" / "dropped")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                if self.drop(conn, n):
                    self.log.append((conn, n, "dropped"))
                    return
                self.log.append((conn, n, "answered"))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM))
                await writer.drain()
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def run_sequence(drop: Callable[[int, int], bool], requests: int, traced: bool = True
                       ) -> tuple[list, RawServer, dict]:
    server = RawServer(drop)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    ledger = Ledger()
    results = []
    try:
        traces = [reuse_tracing()] if traced else []
        async with aiohttp.ClientSession(trace_configs=traces) as http:
            for k in range(requests):  # one after the other: each finds the last one's connection idle
                ledger.send(k)
                res = await stream_completion(http, f"http://127.0.0.1:{port}", {"prompt": [1, 2, 3], "stream": True},
                                              clock=MonotonicClock(), timeout_s=10)
                ledger.record(k, classify(res))
                results.append(res)
    finally:
        srv.close()
        await srv.wait_closed()
    return results, server, ledger.report()


@pytest.mark.asyncio
async def test_a_request_dropped_on_a_reused_connection_is_resent_once_on_a_new_one():
    results, server, rep = await run_sequence(lambda conn, n: conn == 0 and n == 1, 3)
    assert [r.ok for r in results] == [True, True, True]
    assert [r.resent for r in results] == [False, True, False]
    # the second request crossed the close on connection 0 and went again on connection 1
    assert server.log == [(0, 0, "answered"), (0, 1, "dropped"), (1, 0, "answered"), (1, 1, "answered")]
    assert rep["completed"] == 3 and rep["lost"] == 0 and rep["resent"] == 1
    assert format_report(rep).endswith("; resent on a new connection 1")


@pytest.mark.asyncio
async def test_a_request_dropped_on_the_connection_opened_for_it_is_lost():
    results, server, rep = await run_sequence(lambda conn, n: n == 0, 2)
    assert [(r.ok, r.status, r.resent) for r in results] == [(False, "connection", False)] * 2
    assert server.log == [(0, 0, "dropped"), (1, 0, "dropped")]
    assert rep["lost"] == 2 and rep["resent"] == 0
    assert rep["lost_examples"][0]["message"] == "Server disconnected"


@pytest.mark.asyncio
async def test_it_is_resent_only_once():
    # connection 0 answers one request then drops the next; connection 1 drops its first: the
    # second request was resent once already, so it is lost, not sent a third time
    results, server, rep = await run_sequence(lambda conn, n: (conn, n) in {(0, 1), (1, 0)}, 2)
    assert [(r.ok, r.resent) for r in results] == [(True, False), (False, True)]
    assert server.log == [(0, 0, "answered"), (0, 1, "dropped"), (1, 0, "dropped")]
    assert rep["lost"] == 1 and rep["resent"] == 1


@pytest.mark.asyncio
async def test_without_the_reuse_tracing_nothing_is_resent():
    results, server, rep = await run_sequence(lambda conn, n: conn == 0 and n == 1, 2, traced=False)
    assert [(r.ok, r.resent) for r in results] == [(True, False), (False, False)]
    assert rep["lost"] == 1

