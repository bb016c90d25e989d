"""The Responses API (``POST /v1/responses``) on the in-process ingress (uvicorn and the real
FastAPI app, scripted replicas behind it): the request is the chat it stands for, the answer a
Response object or its typed events, checked with our own parsing and with the ``openai``
package's client, whose stream accumulator refuses events out of order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.limits import RequestLimits
from tests.router.test_ingress import MODEL, WORDS, Server, assert_clear_error, json_values, post, texts

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
             "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                              "parameters": WEATHER}}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server(RequestLimits(max_body_bytes=64 * 1024, body_timeout_s=1.0, max_messages=8)) as srv:
        yield srv


@pytest.fixture
def scripted(server: Server) -> Iterator[Any]:
    """``scripted(text, finish)``: the replicas answer ``text``'s tokens, the last with finish
    reason ``finish`` ("length": cut at max_output_tokens; "stop": the model ended it) when the
    request's max_output_tokens is the text's length; reset after the test."""
    tok = server.ingress.tokenizer

    def script(text: str, finish: str = "length") -> list[int]:
        server.replicas.script, server.replicas.finish = tok.encode(text), finish
        return server.replicas.script

    yield script
    server.replicas.script, server.replicas.finish = [], "length"


def events_of(r: requests.Response) -> list[dict[str, Any]]:
    """The stream's events, each checked to carry its type in both the SSE ``event:`` line and
    its data."""
    out = []
    for frame in r.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(ln.split(": ", 1) for ln in frame.split("\n"))
        e = json.loads(lines["data"])
        assert lines["event"] == e["type"]
        out.append(e)
    return out


def test_text_input_and_instructions_are_the_chats_messages_and_the_answer_a_response_object(server, scripted):
    """A string input after instructions is the chat [system, user]: the same prompt ids reach
    the engine; the answer is one message item with the text, status completed when the model
    ended it, incomplete (max_output_tokens) when the limit cut it; usage in the Responses names."""
    k = len(scripted(WORDS, "stop"))
    r = post(server, "/v1/responses", {"model": MODEL, "instructions": "be brief", "input": "hello",
                                       "max_output_tokens": k})
    assert r.status_code == 200, r.text
    resp_ids = server.replicas.calls[-1].prompt_token_ids
    post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": k, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]})
    assert server.replicas.calls[-1].prompt_token_ids == resp_ids
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert (body["status"], body["incomplete_details"], body["error"]) == ("completed", None, None)
    [item] = body["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert item["content"] == [{"type": "output_text", "text": WORDS, "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": len(resp_ids), "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": k, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": len(resp_ids) + k}
    assert (body["instructions"], body["max_output_tokens"], body["tools"], body["tool_choice"]) == (
        "be brief", k, [], "none")
    scripted(WORDS, "length")
    body = post(server, "/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": k}).json()
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert body["output"][0]["content"][0]["text"] == WORDS


def test_a_stream_is_the_typed_events_in_order_and_ends_with_the_whole_response(server, scripted):
    """created, in_progress, the message item and its text part added, one text delta per piece,
    text / part / item done, then response.incomplete (cut at max_output_tokens) whose object
    equals the whole answer's; sequence numbers count from 0 without a gap."""
    k = len(scripted(WORDS))
    body = {"model": MODEL, "input": "hello", "max_output_tokens": k}
    r = post(server, "/v1/responses", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * k
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           "response.incomplete"])
    item_id = events[2]["item"]["id"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert {e["item_id"] for e in deltas} == {item_id} and "".join(e["delta"] for e in deltas) == WORDS
    assert events[-4]["text"] == WORDS
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and last["output"][0]["content"][0]["text"] == WORDS
    assert last["output"][0]["id"] == item_id and last["usage"]["output_tokens"] == k
    whole = post(server, "/v1/responses", body).json()
    assert whole["output"][0]["content"] == last["output"][0]["content"]
    assert whole["usage"] == last["usage"] and whole["status"] == last["status"]


def test_the_openai_client_reads_answers_and_streams(server, scripted):
    """The ``openai`` package (nobody here wrote it): responses.create whole and streamed, and
    its stream helper, whose accumulator checks each event against the items it has."""
    k = len(scripted(WORDS, "stop"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):  # not a field of this route: named
        client.responses.create(model=MODEL, input="hi", extra_body={"stop_token_ids": [2]})
    r = client.responses.create(model=MODEL, input="hi", instructions="be brief", max_output_tokens=k)
    assert (r.output_text, r.status, r.usage.output_tokens) == (WORDS, "completed", k)
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=k) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert ("".join(deltas), final.output_text, final.status) == (WORDS, WORDS, "completed")
    scripted('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "stop")
    k = len(server.replicas.script)
    for stream in (False, True):
        if stream:
            with client.responses.stream(model=MODEL, input="weather?", tools=[FLAT_TOOL], tool_choice="required",
                                         max_output_tokens=k) as s:
                kinds = [e.type for e in s]
                r = s.get_final_response()
            assert kinds.count("response.function_call_arguments.done") == 1
        else:
            r = client.responses.create(model=MODEL, input="weather?", tools=[FLAT_TOOL], tool_choice="required",
                                        max_output_tokens=k)
        [call] = r.output
        assert (call.type, call.name, json.loads(call.arguments), r.status) == (
            "function_call", "get_weather", {"city": "Paris"}, "completed")
        assert call.call_id.startswith("call_")


def test_function_calls_whole_and_streamed(server, scripted):
    """tool_choice required: the calls are function_call items (call ids, names, arguments as
    JSON text), status completed; streamed, each item is added, its arguments sent and done, and
    the last event's items equal the whole answer's but for their ids. A named function streams
    its arguments as they come."""
    scripted('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", '
             '"parameters": {"city": "Rome"}}]', "stop")
    body = {"model": MODEL, "input": "weather?", "tools": [FLAT_TOOL], "tool_choice": "required",
            "max_output_tokens": len(server.replicas.script)}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].structured_output["json"]["type"] == "array"
    out = r.json()["output"]
    assert [(o["type"], o["name"], json.loads(o["arguments"]), o["status"]) for o in out] == [
        ("function_call", "get_weather", {"city": c}, "completed") for c in ("Paris", "Rome")]
    assert len({o["call_id"] for o in out}) == 2 and r.json()["status"] == "completed"
    events = events_of(post(server, "/v1/responses", {**body, "stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta"] * 2 + [
        "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]
    final = events[-1]["response"]["output"]
    assert [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in final] == [
        {k: v for k, v in o.items() if k not in ("id", "call_id")} for o in out]
    named = {**body, "tool_choice": {"type": "function", "name": "get_weather"}, "stream": True}
    k = len(scripted('{"city": "Paris"}', "stop"))
    events = events_of(post(server, "/v1/responses", {**named, "max_output_tokens": k}))
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) == k and "".join(pieces) == '{"city": "Paris"}'
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city": "Paris"}'


def test_past_calls_and_their_outputs_are_the_chats_tool_turns(server, scripted):
    """Input items function_call (consecutive ones one assistant turn) and function_call_output
    give the engine the prompt of the equivalent chat, and an output item sent back as input
    (id, status, output_text parts) is taken as it comes."""
    scripted(WORDS)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather in Paris and Rome?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Sunny and rain.", "annotations": [], "logprobs": []}]},
             {"role": "user", "content": "thanks"}]
    r = post(server, "/v1/responses", {"model": MODEL, "input": items, "tools": [FLAT_TOOL], "tool_choice": "none",
                                       "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    got = server.replicas.calls[-1].prompt_token_ids
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in ((1, '{"city": "Paris"}'), (2, '{"city": "Rome"}'))]
    chat = [{"role": "user", "content": "weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            {"role": "assistant", "content": "Sunny and rain."}, {"role": "user", "content": "thanks"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": chat, "tools": [CHAT_TOOL],
                                              "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].prompt_token_ids == got
    assert b"Rome" in server.ingress.tokenizer.decode(got).encode()


def test_a_json_text_format_is_the_calls_output_constraint(server, scripted):
    scripted("{}")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 4, "text": {
        "format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].structured_output == {"json": schema}
    assert r.json()["text"] == {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"store": True}, "store", "not stored"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the conversation so far as input"),
    ({"background": True}, "background", "stored response"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text.logprobs'"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "'input_image' are not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "type 'reasoning' are not supported"),
    ({"input": []}, "input", "must not be an empty list"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools of type 'web_search' are not supported"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tools": [FLAT_TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "cannot both shape"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "'grammar' is not supported"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "needs a name"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "obfuscation"),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"seed": 1}, "seed", "Extra inputs"),
    ({"tools": [FLAT_TOOL]}, "tool_choice", "tool_call_parser"),  # auto, the default with tools, needs a parser
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, param, needle):
    r = post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra})
    assert_clear_error(r, 400, needle)
    assert r.json()["error"]["param"] == param, r.json()


def _words(tokens: int, tag: str) -> str:
    """A text of about ``tokens`` tokens (two per word with this tokenizer)."""
    return " ".join(f"{tag}{i}" for i in range(tokens // 2))


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(server, scripted):
    """truncation auto: an input over the context loses its oldest items, as few as make the prompt
    and max_output_tokens fit, the instructions and the last item kept, never starting at a tool's
    answer whose call was dropped (the next item instead); without it (or with disabled) the same
    input is a 400; an input that fits is sent whole; when the last item alone is over, a 400
    naming input. The Response object says which truncation it ran with."""
    scripted(WORDS)
    tok = server.ingress.tokenizer
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather",
            "arguments": json.dumps({"city": _words(2100, "a")})}
    items = [{"role": "user", "content": _words(1000, "u")}, call,
             {"type": "function_call_output", "call_id": "c1", "output": _words(2000, "t")},
             {"role": "user", "content": "thanks"}]
    body = {"model": MODEL, "instructions": "Be brief.", "input": items, "tools": [FLAT_TOOL], "tool_choice": "none",
            "max_output_tokens": 100}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": items[0]["content"]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": "c1", "content": items[2]["output"]},
            {"role": "user", "content": "thanks"}]
    assert len(tok.encode_chat(chat, [CHAT_TOOL["function"]])) > 4096  # whole: over the context
    assert len(tok.encode_chat(chat[:1] + chat[2:], [CHAT_TOOL["function"]])) > 4096 - 100  # without the first item
    assert len(tok.encode_chat(chat[:1] + chat[3:], [CHAT_TOOL["function"]])) <= 4096 - 100  # a tool's orphan answer
    for truncation in (None, "disabled"):
        r = post(server, "/v1/responses", {**body, "truncation": truncation})
        assert_clear_error(r, 400, "maximum context length is 4096")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [chat[0], chat[4]], "tools": [CHAT_TOOL],
                                              "tool_choice": "none", "max_tokens": 4})
    want = server.replicas.calls[-1].prompt_token_ids  # the prompt of the instructions and the last item
    n = len(server.replicas.calls)
    for stream in (False, True):
        r = post(server, "/v1/responses", {**body, "truncation": "auto", "stream": stream})
        assert r.status_code == 200, r.text
        assert server.replicas.calls[-1].prompt_token_ids == want
        final = r.json() if not stream else events_of(r)[-1]["response"]
        assert final["truncation"] == "auto" and final["usage"]["input_tokens"] == len(want)
    assert len(server.replicas.calls) == n + 2
    small = {**body, "input": [items[0], {"role": "user", "content": "thanks"}], "truncation": "auto"}
    assert post(server, "/v1/responses", small).status_code == 200
    kept_all = server.replicas.calls[-1].prompt_token_ids
    assert post(server, "/v1/responses", {**small, "truncation": "disabled"}).json()["truncation"] == "disabled"
    assert server.replicas.calls[-1].prompt_token_ids == kept_all  # nothing dropped from what fits
    r = post(server, "/v1/responses", {**body, "input": [{"role": "user", "content": _words(5000, "x")}],
                                       "truncation": "auto"})
    assert_clear_error(r, 400, "With truncation auto, the instructions and the input's last item alone")
    assert r.json()["error"]["param"] == "input"


def test_vllms_ignore_eos_and_sampling_extensions_reach_the_call(server, scripted):
    """What vLLM's benchmark client (``vllm bench serve --backend openai-responses``) may send."""
    scripted(WORDS)
    r = post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True,
                                       "store": False, "ignore_eos": True, "top_k": 5, "min_p": 0.1})
    assert r.status_code == 200, r.text
    call = server.replicas.calls[-1]
    assert (call.ignore_eos, call.top_k, call.min_p, call.max_tokens) == (True, 5, 0.1, 2)


def test_the_output_texts_log_probabilities_with_include(server, scripted):
    """include message.output_text.logprobs (with top_logprobs alternatives): the call asks the
    engine for them, and each output token's entry (the chat's shape: token, logprob, bytes,
    top_logprobs) is on the text part, whole; streamed, the deltas carry them and the done event
    and the final Response list them all."""
    from tests.router.test_ingress import scripted_logprob

    k = len(scripted(WORDS, "stop"))
    tok = server.ingress.tokenizer
    body = {"model": MODEL, "input": "hi", "max_output_tokens": k, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].logprobs == 2
    part = r.json()["output"][0]["content"][0]
    ids = tok.encode(WORDS)
    assert [e["token"] for e in part["logprobs"]] == [tok.token_text(t) for t in ids]
    assert [e["logprob"] for e in part["logprobs"]] == [scripted_logprob(t, 2)[0] for t in ids]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] for e in part["logprobs"])
    events = events_of(post(server, "/v1/responses", {**body, "stream": True}))
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    done = next(ev for ev in events if ev["type"] == "response.output_text.done")
    assert streamed == done["logprobs"] == part["logprobs"] == events[-1]["response"]["output"][0]["content"][0][
        "logprobs"]
    r = post(server, "/v1/responses", {k2: v for k2, v in body.items() if k2 != "top_logprobs"})
    assert server.replicas.calls[-1].logprobs == 0 and r.json()["top_logprobs"] == 0


def test_an_empty_tool_list_is_no_tools(server, scripted):
    """``tools: []`` is the Responses API's default, which the Agents SDK sends with no tools."""
    scripted(WORDS)
    r = post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "tools": []})
    assert r.status_code == 200 and (r.json()["tools"], r.json()["tool_choice"]) == ([], "none"), r.text
    assert_clear_error(post(server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": [],
                                                      "tool_choice": "required"}), 400, "tool_choice needs tools")


def test_an_unknown_model_is_a_404_and_metadata_comes_back(server, scripted):
    scripted(WORDS)
    r = post(server, "/v1/responses", {"model": "other", "input": "hi"})
    assert_clear_error(r, 404, "other")
    r = post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                       "metadata": {"run": "7"}, "store": False})
    assert r.status_code == 200 and r.json()["metadata"] == {"run": "7"} and r.json()["store"] is False


items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                           "content": texts(60) | st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": texts(30)}), max_size=3) | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning"]),
                           "call_id": texts(8) | json_values, "name": st.just("get_weather") | json_values,
                           "arguments": texts(20), "output": texts(20) | json_values}),
    json_values), max_size=6)
fields = {
    "model": st.sampled_from([MODEL, "other"]) | json_values,
    "input": texts(120) | items | json_values,
    "instructions": texts(40) | json_values,
    "max_output_tokens": st.integers(-2, 40) | json_values,
    "stream": st.booleans() | json_values,
    "tools": st.just([FLAT_TOOL]) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_weather"}])
    | json_values,
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]) | json_values,
    "store": st.booleans() | json_values,
    "metadata": st.dictionaries(texts(10), texts(10), max_size=3) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
}


def check_response(r: requests.Response) -> None:
    """A 2xx Response (whole, or a stream that ends with the whole Response), or a 4xx with an
    OpenAI error object that says why."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = events_of(r)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    else:
        assert r.json()["object"] == "response" and r.json()["output"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=fields))
def test_fuzzed_bodies_never_get_a_5xx_and_always_a_clear_answer(server, body):
    check_response(post(server, "/v1/responses", body))


def test_a_stored_responses_routes_say_nothing_is_stored(server):
    """OpenAI's retrieve / delete / cancel / input-items routes: a 404 that says why (the openai
    client's responses.retrieve raises NotFoundError with it)."""
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")):
        r = requests.request(method, server.url + path, timeout=10)
        assert_clear_error(r, 404, "responses are not stored by this server")
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("response_id", None)  # not a model's 404
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not stored"):
        client.responses.retrieve("resp_1")
