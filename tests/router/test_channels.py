"""The ingress's end of the stream channels: ``ReplicaStream`` passing each token on once and in
order from its call and its channel's pieces, ``StreamChannels`` opening one channel per replica
and dispatching pieces, and the request router pinning a channel to its replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from fairway.clock import ManualClock
from fairway.policies.classes import ClassesConfig
from fairway.protocol import ChannelCall, GenerateCall, TokenChunk
from observability.stats import FairwayStats
from router.calls import ReplicaStream
from router.channels import StreamChannels
from router.errors import HTTPError
from router.serve_router import FairwayRequestRouter
from tests.factories import until

DEADLINE_S = 5.0


class Holder:
    def room(self) -> None:
        pass


class CallGen:
    """A call's chunks as the replica sends them, released by the test (``send``)."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self.cancelled = False

    def send(self, offset: int, ids: list[int], finished: bool = False) -> None:
        self.q.put_nowait(TokenChunk(token_ids=ids, offset=offset, finished=finished, lane="fast",
                                     replica="rep-a", completion_tokens=offset + len(ids)))

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenChunk:
        item = await self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Opened:
    """``StreamChannels``' ``open_call``: each open is a queue of batches the test feeds."""

    def __init__(self) -> None:
        self.calls: list[ChannelCall] = []
        self.feeds: list[asyncio.Queue] = []

    def __call__(self, call: ChannelCall):
        self.calls.append(call)
        q: asyncio.Queue = asyncio.Queue()
        self.feeds.append(q)

        async def gen():
            while True:
                item = await q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        return gen()


def gcall(rid: str = "r1") -> GenerateCall:
    return GenerateCall(request_id=rid, prompt_token_ids=[1] * 4, block_hashes=(), max_tokens=8, arrival_s=0.0,
                        channel="ing-1")


def stream(channels: StreamChannels, rid: str = "r1") -> tuple[ReplicaStream, CallGen]:
    gen = CallGen()
    return ReplicaStream(gcall(rid), gen, Holder(), None, ClassesConfig(), channels), gen


async def collect(s: ReplicaStream, out: list) -> None:
    async for c in s.rest():
        out.append((c.offset, c.token_ids, c.finished))


@pytest.mark.asyncio
async def test_pieces_pass_in_order_and_the_calls_last_chunk_adds_only_what_is_new():
    opened = Opened()
    chans = StreamChannels("ing-1", opened)
    stats = FairwayStats(level="router", component="ing-1", policy="fairway")
    gen = CallGen()
    s = ReplicaStream(gcall(), gen, Holder(), stats, ClassesConfig(), chans)
    gen.send(0, [1])
    first = await s.first()
    await until(lambda: len(opened.calls) == 1, "the channel opened at the first chunk")
    assert first.token_ids == [1] and opened.calls == [ChannelCall("ing-1", "rep-a")]
    out: list = []
    reader = asyncio.ensure_future(collect(s, out))
    opened.feeds[0].put_nowait([("r1", 1, [2, 3]), ("other", 1, [9])])
    opened.feeds[0].put_nowait([("r1", 3, [4])])
    await until(lambda: len(out) == 2, "two pieces")
    gen.send(1, [2, 3, 4, 5], finished=True)  # the call carries every token since the first piece
    await reader
    assert out == [(1, [2, 3], False), (3, [4], False), (4, [5], True)]
    assert (chans.pieces, chans.dropped) == (2, 1)
    # tokens 1 and 5 came on the call, 2-4 on the channel
    assert stats.counter("stream_tokens", path="call") == 2 and stats.counter("stream_tokens", path="channel") == 3
    opened.feeds[0].put_nowait([("r1", 5, [6])])  # after its end: dropped
    await until(lambda: chans.dropped == 2, "a late piece dropped")


@pytest.mark.asyncio
async def test_a_piece_before_the_first_chunk_waits_and_a_gap_waits_for_the_call():
    opened = Opened()
    chans = StreamChannels("ing-1", opened)
    chans.watch("rep-a")  # another stream opened it already
    await until(lambda: len(opened.feeds) == 1, "the channel opened")
    s, gen = stream(chans)
    opened.feeds[0].put_nowait([("r1", 1, [2])])  # before the call's first chunk reaches the ingress
    await until(lambda: chans.pieces == 1, "the early piece delivered")
    gen.send(0, [1])
    await s.first()
    out: list = []
    reader = asyncio.ensure_future(collect(s, out))
    await until(lambda: len(out) == 1, "the early piece passed on")
    opened.feeds[0].put_nowait([("r1", 4, [5])])  # the piece at 2 was lost: this one waits
    await until(lambda: chans.pieces == 2, "the piece past the gap delivered")
    gen.send(2, [3, 4])  # the call fills the gap (the channel was lost, then came back)
    await until(lambda: len(out) == 3, "the gap filled and the held piece passed on")
    gen.send(2, [3, 4, 5, 6], finished=True)
    await reader
    assert out == [(1, [2], False), (2, [3, 4], False), (4, [5], False), (5, [6], True)]
    assert len(opened.calls) == 1  # one channel per replica


@pytest.mark.asyncio
@pytest.mark.parametrize("error", [RuntimeError("replica died"), asyncio.CancelledError()],
                         ids=["failed", "cancelled"])
async def test_a_call_failed_or_cancelled_under_the_stream_ends_it_with_an_error_not_a_hang(error):
    chans = StreamChannels("ing-1", Opened())
    s, gen = stream(chans)
    gen.send(0, [1])
    await s.first()
    gen.q.put_nowait(error)
    with pytest.raises(HTTPError):
        await asyncio.wait_for(s.rest().__anext__(), DEADLINE_S)
    assert s.done


@pytest.mark.asyncio
async def test_a_failed_channel_is_opened_again_only_after_the_retry_period():
    opened = Opened()
    clock = ManualClock(10.0)
    chans = StreamChannels("ing-1", opened, retry_s=5.0, clock=clock)
    chans.watch("rep-a")
    await until(lambda: len(opened.feeds) == 1, "opened")
    opened.feeds[0].put_nowait(RuntimeError("gone"))
    await until(lambda: len(chans) == 0, "the failed channel forgotten")
    chans.watch("rep-a")
    assert len(opened.calls) == 1
    clock.set(15.0)
    chans.watch("rep-a")
    await until(lambda: len(opened.calls) == 2, "opened again")
    opened.feeds[1].put_nowait(None)  # ends (idle): opened again at once, when asked
    await until(lambda: len(chans) == 0, "the idle channel forgotten")
    chans.watch("rep-a")
    await until(lambda: len(opened.calls) == 3, "opened again after an idle end")
    opened.feeds[2].put_nowait(None)
    await until(lambda: len(chans) == 0, "ended")


def _replica(uid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(uid, DeploymentID("FairwayReplica")), routing_stats={})


@pytest.mark.asyncio
async def test_the_request_router_pins_a_channel_to_its_replica_and_books_nothing():
    r = object.__new__(FairwayRequestRouter)
    r.initialize_state(policy="fairway", policy_options={}, metrics=False, clock=ManualClock(0.0), wall=lambda: 0.0)
    reps = [_replica("a"), _replica("b"), _replica("c")]
    pend = PendingRequest(args=[ChannelCall("ing-1", "b")], kwargs={},
                          metadata=RequestMetadata(request_id="x", internal_request_id="iid-x"))
    assert await r.choose_replicas(reps, pend) == [[reps[1]]]
    gone = PendingRequest(args=[ChannelCall("ing-1", "z")], kwargs={},
                          metadata=RequestMetadata(request_id="y", internal_request_id="iid-y"))
    assert await r.choose_replicas(reps, gone) == [reps]  # its replica is gone: any, which ends it at once
    r.on_request_routed(pend, reps[1].replica_id, None)
    r.on_request_completed(reps[1].replica_id, "iid-x")
    assert r.load.snapshot().running == () and list(r.decision_s) == []  # no decision, no booking


@pytest.mark.asyncio
async def test_a_refused_or_failed_call_leaves_no_registration_behind():
    chans = StreamChannels("ing-1", Opened())
    s, gen = stream(chans, "r9")
    assert chans._sinks == {"r9": s}
    gen.q.put_nowait(RuntimeError("queue full"))
    with pytest.raises(HTTPError):
        await s.first()
    assert chans._sinks == {}  # not closed (a refusal runs nothing), and no longer fed
