"""The replica's stream coalescing on a manual clock: exact chunks out for a given arrival pattern."""

from __future__ import annotations

import pytest

from fairway.clock import ManualClock
from fairway.protocol import TokenChunk
from replicas.stream import coalesce

pytestmark = pytest.mark.asyncio


async def source(clock: ManualClock, steps: list[tuple[float, list[int]]], finish: bool = True, log=None):
    """One chunk per (time, tokens); the last is the finishing one (with the first's metadata)."""
    try:
        for i, (t, ids) in enumerate(steps):
            clock.set(t)
            last = finish and i == len(steps) - 1
            yield TokenChunk(token_ids=ids, finished=last, finish_reason="length" if last else None,
                             cached_tokens=64 if (i == 0 or last) else 0, lane="fast" if (i == 0 or last) else "")
    finally:
        if log is not None:
            log.append("closed")


async def collect(gen) -> list[TokenChunk]:
    return [c async for c in gen]


async def test_first_at_once_then_merged_per_interval_and_the_last_at_once():
    clock = ManualClock()
    steps = [(0.000, [1]), (0.006, [2]), (0.012, [3]), (0.050, [4]), (0.056, [5]), (0.060, [6])]
    out = await collect(coalesce(source(clock, steps), 0.05, clock))
    assert [c.token_ids for c in out] == [[1], [2, 3, 4], [5, 6]]
    assert [c.finished for c in out] == [False, False, True]
    assert out[0].lane == "fast" and out[0].cached_tokens == 64  # the first chunk's metadata intact
    assert out[-1].finish_reason == "length" and out[-1].cached_tokens == 64 and out[-1].lane == "fast"


async def test_zero_interval_passes_every_chunk():
    clock = ManualClock()
    steps = [(0.0, [1]), (0.001, [2]), (0.002, [3])]
    out = await collect(coalesce(source(clock, steps), 0.0, clock))
    assert [c.token_ids for c in out] == [[1], [2], [3]]


async def test_held_tokens_leave_when_the_source_ends_without_finishing():
    clock = ManualClock()
    out = await collect(coalesce(source(clock, [(0.0, [1]), (0.01, [2]), (0.02, [3])], finish=False), 1.0, clock))
    assert [c.token_ids for c in out] == [[1], [2, 3]] and not out[-1].finished


async def test_closing_the_coalesced_stream_closes_the_source():
    clock, log = ManualClock(), []
    gen = coalesce(source(clock, [(0.0, [1]), (0.01, [2]), (0.02, [3])], log=log), 1.0, clock)
    assert (await gen.__anext__()).token_ids == [1]
    await gen.aclose()  # a client that went away
    assert log == ["closed"]


async def test_the_gates_acknowledgement_passes_at_once_and_does_not_delay_the_first_token():
    clock = ManualClock()

    async def acked():
        yield TokenChunk(token_ids=[], accepted=True)
        clock.set(0.010)
        yield TokenChunk(token_ids=[1])
        clock.set(0.020)
        yield TokenChunk(token_ids=[2], finished=True)

    out = await collect(coalesce(acked(), 0.05, clock))
    assert [(c.accepted, c.token_ids) for c in out] == [(True, []), (False, [1]), (False, [2])]


async def test_log_probabilities_merge_with_their_tokens():
    """With logprobs asked for, a merged chunk keeps one entry per token, in order (a finishing
    chunk with no token brings none)."""
    clock = ManualClock()

    async def lp_source():
        for t, ids, done in ((0.0, [1], False), (0.01, [2, 3], False), (0.02, [4], False), (0.03, [], True)):
            clock.set(t)
            yield TokenChunk(token_ids=ids, finished=done, logprobs=[(-0.5 * i, ((i, -0.5 * i),)) for i in ids])

    out = await collect(coalesce(lp_source(), 1.0, clock))
    assert [c.token_ids for c in out] == [[1], [2, 3, 4]]
    assert [[x[0] for x in c.logprobs] for c in out] == [[-0.5], [-1.0, -1.5, -2.0]]
    assert out[1].logprobs[2][1] == ((4, -2.0),)
