"""The ``sim`` engine in real time: the engine model's prefix cache, token counts and limits,
seen through the ``Engine`` protocol the gate uses (run 1000x faster than real time)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import pytest_asyncio

from fairway.hashing import block_hashes
from fairway.protocol import GenerateCall, RequestTooLarge, UnsupportedParameter
from replicas.engines import make_engine

pytestmark = pytest.mark.asyncio


def call(rid: str, ids: list[int], max_tokens: int = 3) -> GenerateCall:
    return GenerateCall(request_id=rid, prompt_token_ids=ids, block_hashes=tuple(block_hashes(ids)),
                        max_tokens=max_tokens, arrival_s=0.0)


async def run(engine, c: GenerateCall) -> tuple[list[int], int]:
    tokens: list[int] = []
    cached = -1
    async for out in engine.generate(c):
        tokens += out.token_ids
        if out.cached_tokens is not None:
            cached = out.cached_tokens
        if out.finished:
            assert out.finish_reason == "length"
    return tokens, cached


@pytest_asyncio.fixture
async def engine():
    e = make_engine("sim", speed=1000.0, kv_blocks=64, max_model_len=2048)
    stored: list[int] = []
    removed: list[int] = []
    e.set_cache_listener(stored.extend, removed.extend)
    e.events = (stored, removed)
    await e.start()
    yield e
    await e.shutdown()


async def test_tokens_and_prefix_hits(engine):
    shared = list(range(100, 100 + 320))  # 20 full blocks
    tokens, cached = await run(engine, call("a", shared + [5] * 8, max_tokens=5))
    assert len(tokens) == 5 and all(16 <= t < 4096 for t in tokens) and cached == 0
    _, cached = await run(engine, call("b", shared + [6] * 8))
    assert cached == 320  # every shared full block, from the engine model's cache
    stored, _ = engine.events
    assert set(block_hashes(shared)) <= set(stored)


async def test_generated_blocks_are_cached_for_the_next_turn(engine):
    prompt = list(range(200, 200 + 32))
    out, _ = await run(engine, call("t1", prompt, max_tokens=40))
    follow = prompt + out + [9] * 10  # the next turn sends the previous output back
    _, cached = await run(engine, call("t2", follow))
    assert cached == (len(prompt) + len(out) - 1) // 16 * 16


async def test_limits_raise_clear_errors(engine):
    # the context length is the gate's check (tests/replicas/test_gate.py); the engine refuses what its KV cannot hold
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        await run(engine, call("kv", [20] * 1100, max_tokens=16))  # 70 blocks > 64


async def test_memory_bound_can_fit_and_concurrent_requests_finish(engine):
    a = list(range(300, 300 + 640))  # 40 blocks of 64
    assert engine.can_fit(len(a), block_hashes(a))
    t = asyncio.create_task(run(engine, call("a", a, max_tokens=200)))
    deadline = asyncio.get_running_loop().time() + 5.0
    while engine.stats().kv_blocks_free > 64 - 41:  # until a's blocks are allocated
        assert asyncio.get_running_loop().time() < deadline, "request a never got its KV blocks"
        await asyncio.sleep(0)
    b = list(range(1000, 1000 + 640))
    assert not engine.can_fit(len(b), block_hashes(b))  # a holds 41 of 64 blocks
    results = await asyncio.gather(t, run(engine, call("b", b, max_tokens=5)))
    assert [len(r[0]) for r in results] == [200, 5]
    assert engine.stats().running == 0


async def test_a_consumer_that_leaves_aborts_the_request(engine):
    """Closing the stream after its first output (a client disconnect) aborts the request in the
    model at once: nothing left running or waiting, every block free, the abort counted."""
    gen = engine.generate(call("long", list(range(100, 400)), max_tokens=500))
    first = await gen.__anext__()
    assert first.token_ids and not first.finished
    assert engine.stats().running == 1
    await gen.aclose()
    st = engine.stats()
    assert (st.running, st.kv_blocks_free, engine.aborted) == (0, st.kv_blocks_total, 1)
    tokens, _ = await run(engine, call("next", list(range(100, 400)), max_tokens=3))
    assert len(tokens) == 3  # the engine keeps serving


# -- a host KV tier (engine_args: host_kv_blocks) ----------------------------------------------


async def test_a_host_tier_reports_which_hashes_are_host_only_and_none_without_one(engine):
    """With ``host_kv_blocks`` the engine forwards the block pool's tier events: a prompt evicted
    from the GPU by another becomes host-only (its KV events say nothing: it is still cached),
    and its next request reloads it (a host hit) and turns it back. Without a host tier the
    tier listener is never called and the host-only set is empty."""
    e = make_engine("sim", speed=1000.0, kv_blocks=8, max_model_len=2048, host_kv_blocks=64)
    stored: list[int] = []
    removed: list[int] = []
    tier: list[tuple[bool, int]] = []
    e.set_cache_listener(stored.extend, removed.extend)
    e.set_tier_listener(tier.extend)
    await e.start()
    try:
        a, b = list(range(100, 212)), list(range(1000, 1112))  # 7 full blocks each; 8 GPU blocks
        ha, hb = block_hashes(a), block_hashes(b)
        assert (await run(e, call("a", a, max_tokens=1)))[1] == 0
        assert tier == [] and stored == ha
        assert (await run(e, call("b", b, max_tokens=1)))[1] == 0
        # b's blocks pushed a's out of the GPU, all but its first: host-only, last evicted first
        assert tier == [(True, ha[i]) for i in (6, 5, 4, 3, 2, 1)] and removed == []
        assert sorted(e.host_only_hashes()) == sorted(ha[1:7])
        tier.clear()
        assert (await run(e, call("a2", a, max_tokens=1)))[1] == 96  # 1 GPU block + 5 reloaded
        assert e.model.host_hit_tokens == 80
        assert tier == [(True, h) for h in hb[1:7][::-1]] + [(False, ha[i]) for i in range(1, 7)]
        assert sorted(e.host_only_hashes()) == sorted(hb[1:7])
        assert removed == []  # both tiers together hold everything: no KV removal
    finally:
        await e.shutdown()
    # no host tier (the fixture's engine): no tier event, ever
    seen: list = []
    engine.set_tier_listener(seen.extend)
    for i in range(6):  # 6 x 40 blocks through 64: evictions
        await run(engine, call(f"p{i}", list(range(5000 * (i + 1), 5000 * (i + 1) + 640)), max_tokens=1))
    assert engine.events[1] and seen == [] and engine.host_only_hashes() == []


@pytest.mark.parametrize("bad", [{"host_kv_blocks": -1}, {"host_kv_blocks": True}, {"host_kv_blocks": 1.5},
                                 {"host_link_bytes_per_s": 0}, {"host_link_bytes_per_s": float("inf")},
                                 {"host_link_bytes_per_s": "fast"}])
async def test_host_tier_engine_args_are_checked(bad):
    with pytest.raises(ValueError, match="host_"):
        make_engine("sim", **bad)


async def test_a_seed_makes_the_output_a_function_of_the_seed_and_the_prompt(engine):
    """OpenAI's ``seed`` on a text-less engine: same seed and prompt, same tokens, whatever else
    ran before; another seed or another prompt, other tokens; without a seed, each request draws."""
    prompt = list(range(300, 340))

    def seeded(rid: str, seed: int | None, ids: list[int] = prompt) -> GenerateCall:
        c = call(rid, ids, max_tokens=12)
        c.seed = seed
        return c

    a, _ = await run(engine, seeded("a", 7))
    await run(engine, call("other", [9] * 20))
    b, _ = await run(engine, seeded("b", 7))
    c, _ = await run(engine, seeded("c", 8))
    d, _ = await run(engine, seeded("d", 7, prompt + [1]))
    e1, _ = await run(engine, seeded("e1", None))
    e2, _ = await run(engine, seeded("e2", None))
    assert a == b and len({tuple(a), tuple(c), tuple(d)}) == 3 and e1 != e2


async def answer(engine, c: GenerateCall) -> tuple[list[int], str | None]:
    """The tokens of ``c`` and its finish reason."""
    tokens: list[int] = []
    reason = None
    async for out in engine.generate(c):
        tokens += out.token_ids
        if out.finished:
            reason = out.finish_reason
    return tokens, reason


def eos_call(rid: str, max_tokens: int, ignore_eos: bool = False, seed: int | None = None) -> GenerateCall:
    c = call(rid, [7] * 20 + [int(rid[1:]) % 1000], max_tokens=max_tokens)
    c.ignore_eos, c.seed = ignore_eos, seed
    return c


async def test_without_ignore_eos_each_answer_ends_at_its_drawn_end_of_sequence():
    """A request that does not set ``ignore_eos`` stops at its drawn natural length ("stop") when
    that comes before ``max_tokens``, else at ``max_tokens`` ("length"); the lengths have about
    the configured mean; ``ignore_eos`` runs every request to ``max_tokens``."""
    e = make_engine("sim", speed=1000.0, kv_blocks=512, max_model_len=2048, eos_mean_tokens=8)
    await e.start()
    try:
        free = [await answer(e, eos_call(f"r{i}", 64)) for i in range(40)]
        forced = [await answer(e, eos_call(f"f{i}", 64, ignore_eos=True)) for i in range(5)]
    finally:
        await e.shutdown()
    lengths = [len(t) for t, _ in free]
    assert all((r == "stop") == (n < 64) and n >= 1 for n, (_, r) in zip(lengths, free, strict=True))
    assert sum(r == "stop" for _, r in free) >= 35  # P(natural >= 64) = (7/8)^63, about 2e-4
    assert 4 <= sum(lengths) / len(lengths) <= 16
    assert [(len(t), r) for t, r in forced] == [(64, "length")] * 5


async def test_a_seeded_answer_stops_at_the_same_token_and_is_the_ignore_eos_answer_cut_there():
    """OpenAI's ``seed`` covers the length too: the same seed and prompt end at the same token,
    and the answer is the start of what ``ignore_eos`` gives for that seed (the length is drawn
    after the tokens)."""
    e = make_engine("sim", speed=1000.0, kv_blocks=512, max_model_len=2048, eos_mean_tokens=8)
    await e.start()
    try:
        a, ra = await answer(e, eos_call("r1", 64, seed=11))
        b, rb = await answer(e, eos_call("r1", 64, seed=11))
        full, rf = await answer(e, eos_call("r1", 64, ignore_eos=True, seed=11))
    finally:
        await e.shutdown()
    assert (a, ra) == (b, rb) and ra == "stop" and rf == "length"
    assert len(a) < 64 and full[: len(a)] == a


async def test_min_tokens_allows_no_end_before_it_and_the_same_stop_chance_after():
    """vLLM's ``min_tokens``: no answer ends before that many tokens; past it each ends at the
    same per-token chance (mean min_tokens - 1 + eos_mean), and an answer that would have ended
    later anyway is the one without min_tokens (same seed)."""
    e = make_engine("sim", speed=1000.0, kv_blocks=512, max_model_len=2048, eos_mean_tokens=8)
    await e.start()
    try:
        held = []
        for i in range(40):
            c = eos_call(f"m{i}", 200)
            c.min_tokens = 20
            held.append(await answer(e, c))
        free, kept = [], []
        for i in range(40):  # seeded: with and without min_tokens 3, the same draw
            a = await answer(e, eos_call(f"s{i}", 200, seed=i))
            c = eos_call(f"s{i}", 200, seed=i)
            c.min_tokens = 3
            free.append(a)
            kept.append(await answer(e, c))
    finally:
        await e.shutdown()
    lengths = [len(t) for t, _ in held]
    assert min(lengths) >= 20 and all(r == "stop" for _, r in held)
    assert 22 <= sum(lengths) / len(lengths) <= 34  # 27 expected
    for (a, _), (b, _) in zip(free, kept, strict=True):
        assert len(b) >= 3 and (b == a if len(a) >= 3 else b[: len(a)] == a)


async def test_eos_mean_tokens_zero_runs_every_request_to_max_tokens_and_bad_values_are_refused():
    e = make_engine("sim", speed=1000.0, kv_blocks=512, max_model_len=2048, eos_mean_tokens=0)
    await e.start()
    try:
        got = [await answer(e, eos_call(f"r{i}", 20)) for i in range(5)]
    finally:
        await e.shutdown()
    assert [(len(t), r) for t, r in got] == [(20, "length")] * 5
    for bad in (-1, True, 2.5, "256"):
        with pytest.raises(ValueError, match="eos_mean_tokens"):
            make_engine("sim", eos_mean_tokens=bad)


@pytest.mark.parametrize("field,value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0),
                                         ("repetition_penalty", 1.1), ("logit_bias", {42: 3.0}),
                                         ("bad_words", ("gamma",)), ("prompt_logprobs", 1)])
async def test_penalties_and_logit_bias_are_refused_by_name_unless_no_ops(engine, field, value):
    c = call("p", [5] * 20)
    setattr(c, field, value)
    with pytest.raises(UnsupportedParameter, match=f"^{field} is not supported by the sim engine"):
        await run(engine, c)
    ok = call("q", [5] * 20)
    ok.frequency_penalty, ok.repetition_penalty, ok.logit_bias, ok.top_p = 0.0, 1.0, {}, 0.3
    tokens, _ = await run(engine, ok)
    assert len(tokens) == 3


async def test_allowed_token_ids_are_the_only_ids_drawn_and_a_seed_still_fixes_them(engine):
    """vLLM's allowed_token_ids: every output id is one of them (special ids below 16 included);
    with a seed the same prompt gives the same ids."""
    allowed = (3, 77, 4000)
    c = call("a1", [5] * 20, max_tokens=60)
    c.allowed_token_ids = allowed
    tokens, _ = await run(engine, c)
    assert len(tokens) == 60 and set(tokens) == set(allowed)  # 60 draws from 3: each seen
    seeded = [call(f"s{i}", [5] * 20, max_tokens=20) for i in range(2)]
    for c in seeded:
        c.allowed_token_ids, c.seed = allowed, 11
    assert (await run(engine, seeded[0]))[0] == (await run(engine, seeded[1]))[0]


@pytest.mark.parametrize("param,what", [("response_format", "response_format json_object / json_schema"),
                                        ("tool_choice", "a tool_choice that forces a call"),
                                        ("structured_outputs", "structured_outputs")])
async def test_an_output_constraint_is_refused_naming_the_field_it_came_from(engine, param, what):
    c = call("s", [5] * 20)
    c.structured_output, c.structured_output_param = {"choice": ["a", "b"]}, param
    with pytest.raises(UnsupportedParameter, match=f"^{what}.* is not supported by the sim engine") as e:
        await run(engine, c)
    assert e.value.param == param


async def test_the_stream_interval_holds_later_outputs_until_the_finish(engine):
    """With a stream interval the engine yields a request's first output and then nothing until
    the interval has passed or the request finishes: here (an hour's interval, 1000x speed) the
    first token alone, then the other 19 with the finish; the same tokens either way."""
    c = replace(call("i", list(range(300, 300 + 40)), max_tokens=20), seed=7)  # the same output twice
    engine.stream_interval_s = 0.0
    every = [out.token_ids async for out in engine.generate(c)]
    assert [len(t) for t in every] == [1] * 20
    engine.stream_interval_s = 3600.0
    held = [out.token_ids async for out in engine.generate(c)]
    assert [len(t) for t in held] == [1, 19]
    assert sum(held, []) == sum(every, [])


@pytest.mark.parametrize("tiered, first", [(False, ["batch", "interactive"]), (True, ["interactive", "batch"])])
async def test_with_tiers_an_interactive_prompt_is_not_prefilled_behind_a_batch_prompt(tiered, first):
    """A 4,096-token batch prompt and then a 256-token interactive one reach the engine together
    (a 512-token step budget: the batch prompt needs 8 steps of prefill). FCFS, as stock vLLM,
    computes the batch prompt first; with ``tiers`` the engine takes the interactive request first
    and runs no batch prefill until its prefill is done."""
    from fairway.policies.classes import ClassesConfig

    tiers = ClassesConfig.parse("interactive:tier=0:objective=1,batch:tier=1:objective=30") if tiered else None
    e = make_engine("sim", speed=1000.0, kv_blocks=1024, max_model_len=8192, max_num_batched_tokens=512,
                    tiers=tiers)
    await e.start()
    order: list[str] = []

    async def one(klass: str, ids: list[int]) -> None:
        c = call(klass, ids, max_tokens=2)
        c.priority_class = klass
        async for _ in e.generate(c):
            if klass not in order:
                order.append(klass)

    try:
        await asyncio.gather(one("batch", list(range(1000, 1000 + 4096))), one("interactive", [7] * 256))
    finally:
        await e.shutdown()
    assert order == first


async def test_tiers_need_a_class():
    from fairway.policies.classes import ClassesConfig

    with pytest.raises(Exception, match="tiers needs at least one request class"):
        make_engine("sim", tiers=ClassesConfig.parse(""))


def test_a_slowed_engine_reports_its_time_scale():
    """The gate's stall bound stretches by the engine's ``time_scale``: 1 / speed for the sim engine."""
    assert make_engine("sim", speed=0.25, kv_blocks=64, max_model_len=2048).time_scale == 4.0
    assert make_engine("sim", kv_blocks=64, max_model_len=2048).time_scale == 1.0


def test_the_long_prefill_cap_reaches_the_engine_model_and_the_gate_and_bad_values_are_refused():
    """``long_prefill_token_threshold`` (vLLM's option): the engine model caps a prompt's chunk
    with it, and the gate's first-step hold reads it from the engine."""
    engine = make_engine("sim", kv_blocks=64, max_model_len=2048, long_prefill_token_threshold=512)
    assert engine.long_prefill_token_threshold == 512
    assert engine.model.config.long_prefill_token_threshold == 512
    assert make_engine("sim", kv_blocks=64, max_model_len=2048).long_prefill_token_threshold == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
            make_engine("sim", kv_blocks=64, max_model_len=2048, long_prefill_token_threshold=bad)
