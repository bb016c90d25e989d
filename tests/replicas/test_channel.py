"""The replica's stream channels (``replicas/channel.py``): which chunks go on the call and which
on the channel, the call's self-sufficiency when a channel goes, flushing and the idle end."""

from __future__ import annotations

import asyncio

import pytest

from fairway.clock import ManualClock
from fairway.protocol import GenerateCall, TokenChunk
from replicas.channel import Channels
from tests.factories import until

pytestmark = pytest.mark.asyncio

DEADLINE_S = 5.0


def gcall(rid: str = "r1", channel: str = "ing-1", logprobs: int | None = None) -> GenerateCall:
    return GenerateCall(request_id=rid, prompt_token_ids=[1] * 4, block_hashes=(), max_tokens=8, arrival_s=0.0,
                        channel=channel, logprobs=logprobs)


class Steps:
    """A call's chunks, each released by the test (``step``), so the channel's turns are exact."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks
        self.go: asyncio.Queue[None] = asyncio.Queue()
        self.closed = False

    async def gen(self):
        try:
            for i, ids in enumerate(self.chunks):
                await self.go.get()
                yield TokenChunk(token_ids=ids, finished=i == len(self.chunks) - 1, completion_tokens=0)
        finally:
            self.closed = True

    def step(self) -> None:
        self.go.put_nowait(None)


async def drain_into(out: list, agen) -> None:
    async for item in agen:
        out.append(item)


async def opened(ch: Channels, ingress: str = "ing-1") -> tuple[list, asyncio.Future]:
    """``ingress``'s channel served into a list of batches, once it is open; and its task."""
    batches: list = []
    served = asyncio.ensure_future(drain_into(batches, ch.serve(ingress)))
    await until(lambda: ingress in ch._open, "the channel opened")
    return batches, served


async def test_without_an_open_channel_every_chunk_goes_on_the_call_with_its_offset():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    s = Steps([[1], [2, 3], [4], [5]])
    for _ in s.chunks:
        s.step()
    out = [c async for c in ch.relay(gcall(), s.gen())]
    assert [(c.offset, c.token_ids, c.finished) for c in out] == [
        (0, [1], False), (1, [2, 3], False), (3, [4], False), (4, [5], True)]
    assert s.closed


async def test_the_first_and_last_chunks_go_on_the_call_the_middle_ones_on_the_channel():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    batches, served = await opened(ch)
    s = Steps([[1], [2, 3], [4], [5, 6]])
    out: list[TokenChunk] = []
    relay = asyncio.ensure_future(drain_into(out, ch.relay(gcall(), s.gen())))
    s.step()
    await until(lambda: len(out) == 1, "the first chunk on the call")
    s.step()
    s.step()  # two middle chunks in one turn of the channel's: one batch
    await until(lambda: sum(map(len, batches)) == 2, "the middle chunks on the channel")
    s.step()
    await relay
    assert [(c.offset, c.token_ids, c.finished) for c in out] == [(0, [1], False), (1, [2, 3, 4, 5, 6], True)]
    assert batches == [[("r1", 1, [2, 3]), ("r1", 3, [4])]]
    served.cancel()


async def test_pieces_of_several_streams_leave_in_one_flush():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    batches, served = await opened(ch)
    streams = [Steps([[10 * k], [10 * k + 1], [10 * k + 2]]) for k in range(3)]
    outs: list[list] = [[], [], []]
    relays = [asyncio.ensure_future(drain_into(outs[k], ch.relay(gcall(f"r{k}"), s.gen())))
              for k, s in enumerate(streams)]
    for s in streams:
        s.step()
    await until(lambda: all(len(o) == 1 for o in outs), "every first chunk")
    for s in streams:  # one "engine step": every stream's middle chunk in the same turn
        s.step()
    await until(lambda: sum(map(len, batches)) == 3, "the middle chunks")
    assert batches == [[("r0", 1, [1]), ("r1", 1, [11]), ("r2", 1, [21])]]
    for s in streams:
        s.step()
    await asyncio.gather(*relays)
    assert [o[-1].token_ids for o in outs] == [[1, 2], [11, 12], [21, 22]]  # the call carries the pieces again
    assert ch.flushes == 1
    served.cancel()


async def test_a_channel_gone_mid_stream_leaves_the_call_with_every_token_since_the_first_piece():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    batches, served = await opened(ch)
    s = Steps([[1], [2], [3], [4], [5]])
    out: list[TokenChunk] = []
    relay = asyncio.ensure_future(drain_into(out, ch.relay(gcall(), s.gen())))
    s.step()
    s.step()
    await until(lambda: sum(map(len, batches)) == 1, "one piece on the channel")
    served.cancel()
    await until(lambda: len(ch) == 0, "the channel gone")
    s.step()  # no channel: on the call, with the piece the channel may have lost
    await until(lambda: len(out) == 2, "the next chunk on the call")
    s.step()
    s.step()
    await relay
    assert [(c.offset, c.token_ids) for c in out] == [(0, [1]), (1, [2, 3]), (3, [4]), (4, [5])]


async def test_a_call_that_asks_for_log_probabilities_keeps_every_chunk():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    batches, served = await opened(ch)
    s = Steps([[1], [2], [3]])
    for _ in s.chunks:
        s.step()
    out = [c async for c in ch.relay(gcall(logprobs=1), s.gen())]
    assert [(c.offset, c.token_ids) for c in out] == [(0, [1]), (1, [2]), (2, [3])] and batches == []
    served.cancel()


async def test_an_idle_channel_ends_but_not_while_a_stream_uses_it():
    ch = Channels(ManualClock(), min_gap_s=0.0, idle_s=0.02)
    s = Steps([[1], [2], [3]])
    batches, served = await opened(ch)
    relay = asyncio.ensure_future(drain_into([], ch.relay(gcall(), s.gen())))
    s.step()
    s.step()
    await until(lambda: len(batches) == 1, "a piece sent")
    await asyncio.sleep(0.1)  # several idle periods pass while the stream is still open
    assert not served.done()
    s.step()
    await relay
    await asyncio.wait_for(served, DEADLINE_S)  # then it ends by itself
    assert len(ch) == 0


async def test_a_second_open_by_the_same_ingress_ends_the_first():
    ch = Channels(ManualClock(), min_gap_s=0.0)
    first = asyncio.ensure_future(drain_into([], ch.serve("ing-1")))
    await until(lambda: len(ch) == 1, "the channel opened")
    second = asyncio.ensure_future(drain_into([], ch.serve("ing-1")))
    await asyncio.wait_for(first, DEADLINE_S)
    assert len(ch) == 1 and not second.done()
    second.cancel()
