"""Incremental detokenization: the text of one stream's new tokens, as they arrive.

Why not decode each chunk alone: a byte-level tokenizer splits a multi-byte character (an emoji,
most CJK) over several tokens, and a chunk that ends inside one decodes to U+FFFD; sentencepiece
tokenizers also drop a chunk's leading space. So each push decodes the new tokens together with
the tokens of the previous push (their context) and emits only the text past that context, and
holds the text back while it ends in an incomplete character. The deltas of a stream then join to
the text of decoding all its tokens at once.

Cost per push: one decode of (previous push + new tokens), not of the whole stream: O(chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one stream (see the module docstring). Not thread-safe; one per stream."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context: the tokens whose text was emitted last
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; the text they complete ('' while a character is still incomplete)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The text still held back (an incomplete character at the end comes out as decoded)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if not final and (len(text) <= len(context) or text.endswith(REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(context):]


class StopFilter:
    """A stream's text with OpenAI's ``stop`` applied: the text up to (not including) the stop
    string that ends first (of two that end together, the longer), as it arrives (``include``:
    up to and including it, vLLM's ``include_stop_str_in_output``). Text that could be the start
    of a stop string is held back until the next push decides it (at most the longest stop
    string's length - 1 characters). Text pushed with ``armed`` false (vLLM's ``min_tokens``: the
    answer's first tokens) is never searched, and a stop string must end past it. Per push:
    O((held + new text) x stops)."""

    __slots__ = ("_held", "_include", "_keep", "_protected", "_stops", "stopped")

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._include = include
        self._held = ""
        self._protected = 0  # the held text's first characters that came unarmed
        self.stopped = False

    def push(self, text: str, final: bool = False, armed: bool = True) -> str:
        """The text that can be emitted now ('' once stopped); ``final``: nothing more comes."""
        if self.stopped:
            return ""
        buf = self._held + text
        if armed and self._stops:
            # the stop that ends first, as a stream meets them (a tie: the longer); so the cut is
            # the same however the text arrives in pieces
            hits = [(i + len(s), i) for s in self._stops
                    if (i := buf.find(s, max(0, self._protected - len(s) + 1))) >= 0]
            if hits:
                end, cut = min(hits)
                self.stopped = True
                self._held = ""
                return buf[:end] if self._include else buf[:cut]
        protected = len(buf) if not armed else self._protected
        if final or self._keep == 0:
            self._held, self._protected = "", 0
            return buf
        emit = max(0, len(buf) - self._keep)
        self._held, self._protected = buf[emit:], max(0, protected - emit)
        return buf[:emit]
