"""A chat answer's tool calls, written as OpenAI's ``tool_calls``, whole and streamed.

Three kinds of answer (``ToolCallAnswer.mode``):
- a named function (``tool_choice`` names it): the engine's output is constrained to the
  function's arguments (``ChatCompletionRequest.structured_output``); it streams as it is
  generated, its id and name in the first event, its arguments in pieces, as OpenAI's and vLLM's
  streams send them;
- ``REQUIRED``: the output is constrained to a JSON list of ``{"name", "parameters"}`` objects;
- ``AUTO``: free text that the cluster's tool-call parser reads (``PARSERS``, vLLM's names):
  - ``llama3_json``, the format of Llama 3.x's JSON tool calling (vllm-project/vllm,
    vllm/tool_parsers/llama_tool_parser.py): an answer that is one or more ``{"name": ...,
    "parameters": ...}`` objects (``"arguments"`` accepted for ``"parameters"``) separated by
    ``;``. Here an answer is calls only when it starts with ``{`` and is calls whole, on a
    stream as on a whole answer (vLLM's whole answers also look for objects after text, its
    streams do not);
  - ``hermes``, the Hermes / Qwen format (vllm/tool_parsers/hermes_tool_parser.py): text, then
    one or more ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (the last one's
    closing tag may be missing, as vLLM allows). The text before the first block is the
    answer's content; here only whitespace may come between and after the blocks (vLLM drops
    any text there), else the whole answer is text. On a stream the content streams as it
    comes, a possible start of the tag held back, and the calls go in the last event.
A required or auto answer that turns out to be calls is sent in the last event: a call's name and
arguments are known once its JSON ends. An auto answer that starts with anything else streams as
text from its first character. An output cut short (``length``, or a stop the client set) that is
not whole calls is answered as the text it is, with its finish reason, never as a made-up call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

#: ``mode`` of an answer that is a call of the function the request named (``name``)
NAMED = "named"
#: ``mode`` of an answer that is one or more calls of any of the tools (constrained to them)
REQUIRED = "required"
#: ``mode`` of an answer whose calls, if any, the tool-call parser finds in free text
AUTO = "auto"
#: The tool-call parsers a cluster may name (``tool_call_parser``), by vLLM's names
PARSERS = ("llama3_json", "hermes")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def as_call(obj: Any) -> dict[str, Any] | None:
    """``{"name", "parameters" or "arguments"}`` as an OpenAI tool call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj["parameters"] if "parameters" in obj else obj.get("arguments")
    if not isinstance(args, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_required(text: str) -> list[dict[str, Any]] | None:
    """A ``required`` answer's calls, or None when ``text`` is not a whole, non-empty JSON list of
    calls. O(len(text))."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [as_call(it) for it in items]
    return None if None in calls else calls  # type: ignore[return-value]


def parse_llama3_json(text: str) -> list[dict[str, Any]] | None:
    """An auto answer's calls in Llama 3's JSON format (module docstring), or None when ``text``
    is not calls whole. O(len(text))."""
    at, n, calls = 0, len(text), []
    while True:
        while at < n and (text[at].isspace() or (text[at] == ";" and calls)):
            at += 1
        if at == n:
            return calls or None
        if text[at] != "{":
            return None
        try:
            obj, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        call = as_call(obj)
        if call is None:
            return None
        calls.append(call)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """An auto answer's (content, calls) in the Hermes format (module docstring): the content is
    the text before the first ``<tool_call>`` (None when blank); None when ``text`` has no
    whole calls after it. O(len(text))."""
    at = text.find(HERMES_OPEN)
    if at < 0:
        return None
    content, rest, calls = text[:at], text[at:], []
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(HERMES_OPEN):
            return None
        end = rest.find(HERMES_CLOSE)
        body, rest = (rest[len(HERMES_OPEN):], "") if end < 0 else (rest[len(HERMES_OPEN):end],
                                                                   rest[end + len(HERMES_CLOSE):])
        try:
            call = as_call(json.loads(body))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return (content if content.strip() else None), calls


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag`` (held until the next
    piece says). O(len(tag))."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def calls_reason(reason: str) -> str:
    """An answer of calls that the model ended finishes "tool_calls", as OpenAI's API answers."""
    return "tool_calls" if reason == "stop" else reason


@dataclass(slots=True)
class ToolCallAnswer:
    """One answer's tool calls. ``mode``: ``NAMED`` (a call of ``name``), ``REQUIRED`` or
    ``AUTO``. O(output) per answer: a streamed required answer, or an auto one that starts with
    ``{``, keeps its text until its end."""

    mode: str
    name: str = ""  # the named function
    parser: str | None = None  # an AUTO answer's (``PARSERS``; the ingress refuses auto without one)
    id: str = field(default_factory=call_id)  # a named call's id, the same in every event
    parts: list[str] = field(default_factory=list)  # a streamed answer's text held so far
    text: bool = False  # an auto answer found to be text: it streams as content
    pending: str = ""  # a Hermes answer's content end that may start a tag, held

    def message(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole answer's message and finish reason: "tool_calls" for calls that the model
        ended (a named call keeps its own, as OpenAI's API answers)."""
        if self.mode == NAMED:
            return {"role": "assistant", "content": None, "tool_calls": [self._named(text)]}, reason
        parsed = self._parse(text)
        if parsed is None:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}, calls_reason(reason)

    def delta(self, text: str, first: bool, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """A stream event's delta and finish reason for the output's next ``text`` (``reason``
        set on the last event); None when the event has nothing to say (held text, which the
        caller sends only to carry log probabilities)."""
        out: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.mode == NAMED:
            call = self._named(text) if first else {"function": {"arguments": text}}
            out["tool_calls"] = [{"index": 0, **call}]
            return out, reason
        if self.text:
            out["content"] = text
            return out, reason
        if self.mode == AUTO and self.parser == "hermes":
            if self.parts:  # a tag has begun: the rest is held to the end
                self.parts.append(text)
            else:
                if send := self._hermes_content(text, reason):
                    out["content"] = send
                if not self.parts:
                    return (out or None) if reason is None else out, reason  # the last event always goes
        else:
            self.parts.append(text)
            if self.mode == AUTO:  # llama3_json: calls only when the answer starts with "{"
                held = "".join(self.parts)
                if held.strip() and not held.lstrip().startswith("{"):  # text: all of it goes now
                    self.text, self.parts = True, []
                    out["content"] = held
                    return out, reason
        if reason is None:
            return out or None, None
        held = "".join(self.parts)
        parsed = self._parse(held)
        if parsed is None:
            out["content"] = out.get("content", "") + held
            return out, reason
        out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(parsed[1])]
        return out, calls_reason(reason)

    def _hermes_content(self, text: str, reason: str | None) -> str:
        """A Hermes answer's content to send now, before any tag: the text up to a ``<tool_call>``
        (which starts ``parts``), else all of it but an end that could start the tag (``pending``,
        held until the next piece, or sent with the last). O(len(text))."""
        buf = self.pending + text
        at = buf.find(HERMES_OPEN)
        if at >= 0:
            self.parts, self.pending = [buf[at:]], ""
            return buf[:at]
        keep = 0 if reason is not None else held_back(buf, HERMES_OPEN)
        self.pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def _parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """(content, calls) of an answer that is calls, by this answer's rule; None: text."""
        if self.mode == AUTO and self.parser == "hermes":
            return parse_hermes(text)
        calls = parse_required(text) if self.mode == REQUIRED else parse_llama3_json(text)
        return None if calls is None else (None, calls)

    def _named(self, arguments: str) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}
