"""The tool-call answer's parsers and stream states (router/tool_calls.py), on exact texts."""

from __future__ import annotations

import pytest

from router.tool_calls import AUTO, NAMED, REQUIRED, ToolCallAnswer, parse_hermes, parse_llama3_json, parse_required


def fns(calls):
    return None if calls is None else [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text,want", [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')]),
    ('\n {"name": "f", "arguments": {"s": "}{;"}} ;{"name": "g", "parameters": {}}  ',
     [("f", '{"s": "}{;"}'), ("g", "{}")]),
    ('{"name": "f", "parameters": {"city": "Zürich"}}', [("f", '{"city": "Zürich"}')]),
    ("", None), ("   ", None), ("hello", None), ('x {"name": "f", "parameters": {}}', None),
    ('{"name": "f", "parameters": {}} trailing text', None), ('{"name": "f"}', None),
    ('{"name": "f", "parameters": [1]}', None), ('{"name": 3, "parameters": {}}', None),
    ('{"name": "f", "parameters": {', None), ('; {"name": "f", "parameters": {}}', None),
])
def test_llama3_json_is_calls_whole_or_none(text, want):
    assert fns(parse_llama3_json(text)) == want


@pytest.mark.parametrize("text,want", [
    ('[{"name": "f", "parameters": {"a": [1, 2]}}]', [("f", '{"a": [1, 2]}')]),
    ("[]", None), ('{"name": "f", "parameters": {}}', None), ('[{"name": "f"}]', None), ('[{"name": "f", ', None),
])
def test_required_is_a_whole_non_empty_list_of_calls_or_none(text, want):
    assert fns(parse_required(text)) == want


def test_stream_states_by_mode():
    named = ToolCallAnswer(NAMED, "f")
    first, _ = named.delta('{"a"', True, None)
    assert first == {"role": "assistant", "tool_calls": [{"index": 0, "id": named.id, "type": "function",
                                                          "function": {"name": "f", "arguments": '{"a"'}}]}
    assert named.delta(": 1}", False, "stop") == ({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                                                  "stop")
    req = ToolCallAnswer(REQUIRED)
    assert req.delta('[{"name": "f", ', True, None) == ({"role": "assistant"}, None)
    assert req.delta('"parameters": {}}', False, None) == (None, None)  # held: nothing to say
    out, reason = req.delta("]", False, "stop")
    assert fns(out["tool_calls"]) == [("f", "{}")] and out["tool_calls"][0]["index"] == 0 and reason == "tool_calls"
    auto = ToolCallAnswer(AUTO)
    assert auto.delta("  ", True, None) == ({"role": "assistant"}, None)  # whitespace: not yet known
    assert auto.delta(" Hi", False, None) == ({"content": "   Hi"}, None)  # text: all of it, then as it comes
    assert auto.delta(" there", False, "stop") == ({"content": " there"}, "stop")
    cut = ToolCallAnswer(AUTO)
    cut.delta('{"name": "f", ', True, None)
    assert cut.delta('"param', False, "length") == ({"content": '{"name": "f", "param'}, "length")


@pytest.mark.parametrize("text,want", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', (None, [("f", '{"a": 1}')])),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '{"s": "</tool"}}</tool_call>\n', ("Let me look.\n", [("f", "{}"), ("g", '{"s": "</tool"}')])),
    ('<tool_call>{"name": "f", "arguments": {}}', (None, [("f", "{}")])),  # the last closing tag missing
    ("plain text", None), ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and more', None),
    ('<tool_call>{"name": "f"}</tool_call>', None), ("<tool_call>not json</tool_call>", None),
    ('<tool_call>{"name": "f", "arguments": {', None),
])
def test_hermes_is_content_then_whole_calls_or_none(text, want):
    got = parse_hermes(text)
    assert (None if got is None else (got[0], fns(got[1]))) == want


def test_hermes_streams_its_content_and_holds_a_possible_tag():
    ans = ToolCallAnswer(AUTO, parser="hermes")
    assert ans.delta("Sure. <tool", True, None) == ({"role": "assistant", "content": "Sure. "}, None)
    assert ans.delta("_call>{\"name\": \"f\", ", False, None) == (None, None)  # from the tag on: held
    out, reason = ans.delta('"arguments": {}}</tool_call>', False, "stop")
    assert fns(out["tool_calls"]) == [("f", "{}")] and reason == "tool_calls" and "content" not in out
    txt = ToolCallAnswer(AUTO, parser="hermes")
    assert txt.delta("a <", True, None) == ({"role": "assistant", "content": "a "}, None)
    assert txt.delta("b", False, None) == ({"content": "<b"}, None)  # not the tag after all
    assert txt.delta(" <t", False, "length") == ({"content": " <t"}, "length")  # the end: all of it
    end = ToolCallAnswer(AUTO, parser="hermes")
    end.delta("x", True, None)
    assert end.delta("", False, "stop") == ({}, "stop")  # an empty last piece still carries the finish
    whole = ToolCallAnswer(AUTO, parser="hermes")
    msg, reason = whole.message('Hi <tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>', "stop")
    assert (msg["content"], fns(msg["tool_calls"]), reason) == ("Hi ", [("f", '{"x": 2}')], "tool_calls")


def test_the_parsers_are_the_configs_choices():
    from typing import get_args

    from router.ingress import ServedModel
    from router.tool_calls import PARSERS

    assert set(get_args(get_args(ServedModel.model_fields["tool_call_parser"].annotation)[0])) == set(PARSERS)
