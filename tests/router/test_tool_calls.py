"""The tool-call answer's parsers and stream states (router/tool_calls.py), on exact texts."""

from __future__ import annotations

import pytest

from router.tool_calls import AUTO, NAMED, REQUIRED, ToolCallAnswer, parse_llama3_json, parse_required


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
