"""A chat answer that a forced ``tool_choice`` constrained to a call's JSON, written as OpenAI's
``tool_calls``, whole and streamed.

The engine's output is the call's JSON (``ChatCompletionRequest.structured_output``): for a named
function, its arguments; for ``required``, a list of ``{"name", "parameters"}`` objects. A named
call streams as it is generated: its id and name in the first event, its arguments in pieces, as
OpenAI's and vLLM's streams send them. A ``required`` answer is parsed once it is whole and its
calls go in the last event: a call's name and arguments are not known before its JSON ends.
An output cut short (``length``, or a stop the client set) that is not a whole list of calls is
answered as text with its finish reason, never as a made-up call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

#: ``forced`` of an answer that is one or more calls of any of the tools
REQUIRED = "required"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """``text`` as a ``required`` answer's calls in OpenAI's shape (arguments as a JSON text),
    or None when it is not a whole, non-empty list of ``{"name", "parameters"}`` objects.
    O(len(text))."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for it in items:
        if not (isinstance(it, dict) and isinstance(it.get("name"), str) and "parameters" in it):
            return None
        calls.append({"id": call_id(), "type": "function",
                      "function": {"name": it["name"], "arguments": json.dumps(it["parameters"], ensure_ascii=False)}})
    return calls


@dataclass(slots=True)
class ToolCallAnswer:
    """One answer's tool calls. ``forced``: ``REQUIRED``, or the function the request named.
    O(output) per answer: a streamed ``required`` answer keeps its text until its end."""

    forced: str
    id: str = field(default_factory=call_id)  # a named call's id, the same in every event
    parts: list[str] = field(default_factory=list)  # a streamed required answer's text so far

    def message(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole answer's message and finish reason: "tool_calls" for a required answer's
        calls (a named call keeps its own, as OpenAI's API answers)."""
        if self.forced != REQUIRED:
            return {"role": "assistant", "content": None, "tool_calls": [self._named(text)]}, reason
        calls = parse_calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, ("tool_calls" if reason == "stop"
                                                                               else reason)

    def delta(self, text: str, first: bool, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """A stream event's delta and finish reason for the output's next ``text`` (``reason``
        set on the last event); None when the event has nothing to say (a required answer's
        middle, which the caller sends only to carry log probabilities)."""
        out: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.forced != REQUIRED:
            call = self._named(text) if first else {"function": {"arguments": text}}
            out["tool_calls"] = [{"index": 0, **call}]
            return out, reason
        self.parts.append(text)
        if reason is None:
            return out or None, None
        whole = "".join(self.parts)
        calls = parse_calls(whole)
        if calls is None:
            out["content"] = whole
            return out, reason
        out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return out, ("tool_calls" if reason == "stop" else reason)

    def _named(self, arguments: str) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.forced, "arguments": arguments}}
