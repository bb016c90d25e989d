"""The request guard's cheap checks before a body is parsed (``router/limits.py``), and the request
models' bounds that come before their items are validated (``router/openai_api.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

import router.limits as limits_mod
from router.limits import MAX_US_PER_BYTE, RequestGuard, RequestLimits, parse_cost_ms, structure_counts
from router.openai_api import (
    BODY_FACTS,
    MAX_PROMPTS,
    MAX_TOOLS,
    BodyFacts,
    ChatCompletionRequest,
    CompletionRequest,
    body_has_no_surrogate,
    check_text,
    prompt_value,
)
from router.responses_api import ResponsesRequest


def call_guard(body: bytes, limits: RequestLimits) -> tuple[list[BodyFacts | None], list[dict[str, Any]]]:
    """``body`` through a ``RequestGuard`` in front of an app that records the body facts it sees:
    (the facts per app call, the messages the guard itself sent)."""
    seen: list[BodyFacts | None] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(BODY_FACTS.get())

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(len(body)).encode())]}
    asyncio.run(RequestGuard(app, limits)(scope, receive, send))
    assert BODY_FACTS.get() is None  # reset once the app is done
    return seen, sent


def test_the_parse_cost_weighs_each_structural_character():
    assert parse_cost_ms(structure_counts(b'{"a": [1, 2], "b": {}}')) == pytest.approx(
        (2 * 0.6 + 0.5 + 2 * 0.5 + 2 * 0.07) / 1000)
    assert parse_cost_ms(structure_counts(b'"text"')) == 0.0


def test_a_body_too_costly_to_parse_is_refused_before_the_app_sees_it(monkeypatch):
    members = json.dumps({"model": "m", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(200_000)}}).encode()
    assert parse_cost_ms(structure_counts(members)) > 100
    seen, sent = call_guard(members, RequestLimits())
    assert seen == [] and sent[0]["status"] == 413
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert "200003 object members" in message and "limits.max_parse_ms" in message, message
    # the same bytes as text, a bound of 0 (none), and a body under the counted size: handed on
    text = json.dumps({"model": "m", "prompt": "word " * (len(members) // 5)}).encode()
    assert len(text) >= len(members) and call_guard(text, RequestLimits())[0] != []
    assert call_guard(members, RequestLimits(max_parse_ms=0))[0] != []
    # a body that could not pass the bound even at the dearest weight for every byte is not counted
    counted: list[int] = []
    monkeypatch.setattr(limits_mod, "structure_counts", lambda b: counted.append(len(b)) or structure_counts(b))
    fits = int(1000 / MAX_US_PER_BYTE)  # bytes, at max_parse_ms 1
    assert call_guard(b":" * fits, RequestLimits(max_parse_ms=1))[0] != [] and counted == []
    assert call_guard(b":" * (fits + 1), RequestLimits(max_parse_ms=1))[0] == [] and counted == [fits + 1]


def test_the_app_is_told_whether_the_body_can_hold_a_surrogate_and_the_message_bound():
    (facts,), _ = call_guard(b'{"prompt": "plain \\u00e9"}', RequestLimits(max_messages=7))
    assert facts == BodyFacts(no_surrogate=True, max_items=7)
    for body in (b'{"prompt": "half \\ud800 a pair"}', b'{"prompt": "half \\uDC00 a pair"}', '{"p": "é"}'.encode()):
        (facts,), _ = call_guard(body, RequestLimits())
        assert facts is not None and not facts.no_surrogate, body
    assert body_has_no_surrogate(b'{"prompt": "\\\\ud800 is text here"}') is False  # an escaped backslash: "maybe"


def test_text_is_checked_unless_the_body_facts_say_there_is_no_surrogate():
    with pytest.raises(ValueError, match="unpaired surrogate"):
        check_text(["ok", {"x": "\ud800"}])
    token = BODY_FACTS.set(BodyFacts(no_surrogate=True, max_items=10))
    try:
        assert check_text(["ok", {"x": "\ud800"}]) == ["ok", {"x": "\ud800"}]  # the guard saw the bytes
    finally:
        BODY_FACTS.reset(token)


UNION = TypeAdapter(str | list[int] | list[str] | list[list[int]])
values = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, width=16)
                      | st.text(max_size=3) | st.sampled_from(["1", "-2", "1.0"]),
                      lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=3000, deadline=None)
@given(v=values)
def test_the_prompt_is_validated_as_the_union_of_its_four_kinds(v):
    """``prompt_value`` gives the value pydantic's union of the four kinds gives, and refuses what
    it refuses (an empty list is left to ``CompletionRequest``'s own check). One difference, by
    design: a list that starts with a text and goes on with numbers is refused, where the union
    reads its numeric texts as token ids (``["1", 2]`` -> ``[1, 2]``)."""
    try:
        expected = UNION.validate_python(v)
    except ValidationError:
        if v != []:
            with pytest.raises(ValueError):
                prompt_value(v)
        return
    try:
        got = prompt_value(v)
    except ValueError:
        assert isinstance(v, list) and isinstance(v[0], str) and not all(isinstance(x, str) for x in v), v
        assert all(isinstance(x, int) for x in expected), (v, expected)
        return
    assert got == expected and type(got) is type(expected)


def test_long_lists_are_refused_before_their_items_are_read():
    with pytest.raises(ValidationError, match=f"at most {MAX_PROMPTS} prompts, not {MAX_PROMPTS + 1}"):
        CompletionRequest.model_validate({"model": "m", "prompt": [[1]] * (MAX_PROMPTS + 1)})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 3}
    with pytest.raises(ValidationError, match=f"too many tools: {MAX_TOOLS + 1}; the limit is {MAX_TOOLS}"):
        ChatCompletionRequest.model_validate({**chat, "tools": [{"type": "function"}] * (MAX_TOOLS + 1)})
    with pytest.raises(ValidationError, match="at most 16 stop token ids"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop_token_ids": ["not an id"] * 17})
    ChatCompletionRequest.model_validate(chat)  # outside the ingress: no message bound here
    token = BODY_FACTS.set(BodyFacts(no_surrogate=False, max_items=2))
    try:
        with pytest.raises(ValidationError, match="too many messages: 3; the limit is 2"):
            ChatCompletionRequest.model_validate(chat)
        with pytest.raises(ValidationError, match="too many input items: 3; the limit is 2"):
            ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": "hi"}] * 3})
    finally:
        BODY_FACTS.reset(token)


def test_bodies_past_the_receiving_bound_are_read_without_being_kept_and_answered_503():
    """Under a 120 KiB bound: body A holds 100 KiB while its last byte waits; a small body D (30
    KiB) is handed on although the total passes the bound; body B is refused once it holds 100
    KiB with A's, read to its end without being kept, and answered 503 with Retry-After; A then
    completes and is handed on; nothing stays counted."""
    k = 1024
    limits = RequestLimits(max_receiving_bytes=120 * k, max_parse_ms=0)
    handed: list[int] = []
    answers: dict[str, dict[str, Any]] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        handed.append(len((await receive())["body"]))

    async def run() -> RequestGuard:
        guard = RequestGuard(app, limits)
        release_a = asyncio.Event()

        async def body(name: str, parts: list[bytes], wait_before_last: asyncio.Event | None = None) -> None:
            size, left = sum(map(len, parts)), list(parts)

            async def receive() -> dict[str, Any]:
                if not left:
                    return {"type": "http.disconnect"}
                if len(left) == 1 and wait_before_last is not None:
                    await wait_before_last.wait()
                return {"type": "http.request", "body": left.pop(0), "more_body": len(left) > 0}

            async def send(msg: dict[str, Any]) -> None:
                answers.setdefault(name, {}).update(msg)

            scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(size).encode())]}
            await guard(scope, receive, send)

        async def until(cond: Any) -> None:
            for _ in range(1000):
                if cond():
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("timed out")

        a = asyncio.create_task(body("A", [b"a" * (50 * k)] * 2 + [b"a"], release_a))
        await until(lambda: guard.receiving == 100 * k)
        await body("D", [b"d" * (30 * k)])
        await body("B", [b"b" * (50 * k)] * 3)
        assert guard.receiving == 100 * k  # A's, B's released
        release_a.set()
        await a
        return guard

    guard = asyncio.run(run())
    assert handed == [30 * k, 100 * k + 1]  # D, then A; B never
    assert answers["B"]["status"] == 503 and (b"retry-after", b"1") in answers["B"]["headers"]
    assert b"receiving 102400 bytes of other request bodies" in answers["B"]["body"]
    assert b"limits.max_receiving_bytes" in answers["B"]["body"]
    assert guard.receiving == 0
