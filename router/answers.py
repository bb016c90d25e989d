"""A request's choices on their way back, and the answers they make.

Each choice (``Answer``) holds its call, its replica stream and its output as the client gets it
(``Output``: detokenized incrementally, ended at a stop, on any engine), and writes its part of
the answer: a whole body's choice, or a stream event's. ``Replies`` writes the whole answer in the
route's shape: a completion or chat body, their server-sent events (``data:`` chunks, then
``[DONE]``; a failure after the start is an error event, then ``[DONE]``, so a client never
hangs), or a Responses API object or its typed events; ``merged`` interleaves several choices'
streams. The log probabilities in OpenAI's two shapes are ``text_logprobs`` and
``chat_logprobs``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fairway.protocol import MIN_LOGPROB, GenerateCall, PromptLogprob, TokenChunk, TokenLogprob
from router.calls import ReplicaStream
from router.detokenize import IncrementalDetokenizer, StopFilter
from router.errors import HTTPError
from router.openai_api import CODES, ChatCompletionRequest, error_body, new_id, now_s
from router.responses_api import ResponseEvents, ResponsesRequest, finished, whole_output
from router.responses_api import head as responses_head
from router.responses_api import usage as responses_usage
from router.tool_calls import ToolCallAnswer


class Replies:
    """The answer's body or events in the route's shape, from its choices (module docstring).
    ``ingress_name``: named in each answer's ``fairway`` figures; ``rejected``: counts a failure
    after a stream started (its reject metrics)."""

    def __init__(self, ingress_name: str, rejected: Callable[[HTTPError], Any]) -> None:
        self.ingress_name = ingress_name
        self.rejected = rejected

    @staticmethod
    def _filled(first: TokenChunk, last: TokenChunk) -> TokenChunk:
        """The chunk with the request's figures: the last when the answer ran to its end (the
        replica fills it), else the first token's (a stop ended the answer mid-stream)."""
        return last if last.finished else first

    def _usage(self, first: TokenChunk, last: TokenChunk, out: Output) -> dict[str, Any]:
        """The answer's token counts; the completion's as far as a stop cut it."""
        src = self._filled(first, last)
        completion = len(out.ids) if out.stopped else last.completion_tokens
        return {
            "prompt_tokens": src.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": src.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": src.cached_tokens},
        }

    def fairway(self, first: TokenChunk, last: TokenChunk, stream: ReplicaStream) -> dict[str, Any]:
        """The answer's ``fairway`` figures: its lane, replica, waits and TTFTs, class, hold."""
        src = self._filled(first, last)
        out = {"lane": src.lane, "promoted": src.promoted, "replica": src.replica,
               "queue_wait_s": src.queue_wait_s, "ttft_s": stream.ttft_s, "replica_ttft_s": src.ttft_s,
               "ingress": self.ingress_name}
        if stream.call.priority_class:
            out["class"] = stream.call.priority_class
        if stream.held_s:
            out["held_s"] = stream.held_s
        return out

    def whole(self, answers: list[Answer], body: Any, chat: bool) -> dict:
        """A whole answer's body: each answer's choice, the usage of them all, and the first
        answer's ``fairway`` figures (every choice's under ``choices`` when there are several)."""
        first = answers[0]
        assert first.first is not None and first.last is not None and first.stream is not None
        out = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now_s(),
            "model": first.call.model,
            "choices": [a.whole(body, chat) for a in answers],
            "usage": self.usage_of(answers, body.n),
            "fairway": self.fairway(first.first, first.last, first.stream),
        }
        if chat and first.call.prompt_logprobs is not None:  # the chat's, once (vLLM's place)
            out["prompt_logprobs"] = first.prompt_logprobs()
        if len(answers) > 1:
            out["fairway"]["choices"] = [self.fairway(a.first, a.last, a.stream) for a in answers]  # type: ignore
        return out

    def usage_of(self, answers: list[Answer], n: int) -> dict[str, Any]:
        """The answers' usage: each prompt's tokens (and cached tokens) once, as OpenAI and vLLM
        count them, the completions' tokens of every choice. O(answers)."""
        total = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        for a in answers:
            u = self._usage(a.first, a.last, a.out)  # type: ignore[arg-type]
            total["completion_tokens"] += u["completion_tokens"]
            if a.index % n == 0:  # the prompt's first choice
                total["prompt_tokens"] += u["prompt_tokens"]
                total["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
        return {"prompt_tokens": total["prompt_tokens"], "completion_tokens": total["completion_tokens"],
                "total_tokens": total["prompt_tokens"] + total["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": total["cached_tokens"]}}

    async def sse(self, answers: list[Answer], body: Any, chat: bool, include_usage: bool,
                  continuous: bool = False) -> AsyncIterator[str]:
        """A chat or completions stream: a chunk per event (each with its choice's usage so far
        with ``continuous``), then with ``include_usage`` one with the whole request's usage."""
        rid = new_id("chatcmpl" if chat else "cmpl")
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now_s()
        model = body.model

        def frame(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                          "choices": choices, **extra}) + "\n\n"

        try:
            async for a, c, first in chunks(answers):
                if first:  # a first one always says
                    ch = a.event(c, body, chat, a.echo, role=True) or {}
                elif (ch := a.event(c, body, chat)) is None:
                    continue
                # with ``continuous``: the choice's usage so far, as far as a stop cut it (``_usage``)
                yield frame([ch], usage=self._usage(a.first, c, a.out)) if continuous else frame([ch])
        except HTTPError as e:
            self.rejected(e)
            yield "data: " + json.dumps(error_body(e.message, e.status)) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            for a in answers:  # the client disconnected mid-stream: abort the requests at their replicas
                a.stream.close()  # type: ignore[union-attr]
        if include_usage:
            first = answers[0]
            yield frame([], usage=self.usage_of(answers, body.n),
                        fairway=self.fairway(first.first, first.last, first.stream))  # type: ignore[arg-type]
        yield "data: [DONE]\n\n"

    def response_object(self, a: Answer, body: ChatCompletionRequest, req: ResponsesRequest) -> dict[str, Any]:
        """A whole answer as a Responses API Response object (router/responses_api.py)."""
        assert a.first is not None and a.last is not None and a.stream is not None
        choice = a.whole(body, chat=True)
        status, details = finished(choice["finish_reason"])
        return {**responses_head(req, new_id("resp", "_")), "status": status, "incomplete_details": details,
                "output": whole_output(choice["message"], (choice.get("logprobs") or {}).get("content")),
                "usage": responses_usage(self.usage_of([a], 1)),
                "fairway": self.fairway(a.first, a.last, a.stream)}

    async def response_events(self, a: Answer, body: ChatCompletionRequest,
                               req: ResponsesRequest) -> AsyncIterator[str]:
        """A streamed answer as the Responses API's events (``ResponseEvents``), from the chat
        events the answer's chunks make; a failure after the start is ``response.failed``."""
        events = ResponseEvents(responses_head(req, new_id("resp", "_")))
        reason: str | None = None

        def frames(evs: list[dict[str, Any]]) -> str:
            return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in evs)

        def on(ch: dict[str, Any] | None) -> list[dict[str, Any]]:
            nonlocal reason
            if ch is None:
                return []
            reason = ch["finish_reason"] or reason
            return events.delta(ch["delta"], (ch.get("logprobs") or {}).get("content"))

        assert a.stream is not None and a.first is not None
        try:
            async for _, c, first in chunks([a]):
                if first:
                    yield frames(events.start() + on(a.event(c, body, True, role=True)))
                elif evs := on(a.event(c, body, True)):
                    yield frames(evs)
        except HTTPError as e:
            self.rejected(e)
            yield frames(events.failed(e.message, CODES.get(e.status)))
            return
        finally:
            a.stream.close()  # the client disconnected mid-stream: abort the request at its replica
        yield frames(events.finish(reason or a.out.finish_reason(a.last), self.usage_of([a], 1),
                                   fairway=self.fairway(a.first, a.last, a.stream)))


async def chunks(answers: list[Answer]) -> AsyncIterator[tuple[Answer, TokenChunk, bool]]:
    """Every answer's chunks as the caller writes them, each with ``last`` kept: first each
    answer's first chunk (flagged), its TTFT taken when the caller asks for the next (its event
    is written by then), then the rest, one answer's in order or several merged; an answer ends
    at its finish or at a stop its output found (the caller's ``Answer.event`` sets
    ``out.stopped``), and a stopped answer's replica call is ended. Why: one loop for every
    stream shape. O(1) per chunk."""
    for a in answers:
        assert a.stream is not None and a.first is not None
        a.last = a.first
        yield a, a.first, True
        a.stream.sent_first()  # the first event is written: the client has its first token
    if len(answers) == 1:
        a = answers[0]
        if not a.out.stopped:
            async for c in a.stream.rest():  # type: ignore[union-attr]
                a.last = c
                yield a, c, False
                if a.out.stopped:
                    break
    else:
        async for a, c in merged(answers):
            a.last = c
            yield a, c, False
    for a in answers:
        if a.out.stopped:
            a.stream.stop()  # type: ignore[union-attr]


async def merged(answers: list[Answer]) -> AsyncIterator[tuple[Answer, TokenChunk]]:
    """The further chunks of every answer not yet ended, as they come; an answer ends at its
    finished chunk or at a stop its output found (the caller's ``event`` sets ``out.stopped``),
    and a failure of any raises here. Why: one stream of events for a request with several
    choices. O(1) per chunk; one task per answer."""
    queue: asyncio.Queue[tuple[Answer, TokenChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(a: Answer) -> None:
        try:
            async for c in a.stream.rest():  # type: ignore[union-attr]
                queue.put_nowait((a, c, None))
        except Exception as e:  # noqa: BLE001 - raised to the reader
            queue.put_nowait((a, None, e))

    live = {id(a): asyncio.ensure_future(pump(a)) for a in answers if not (a.out.stopped or a.first.finished)}  # type: ignore[union-attr]
    try:
        while live:
            a, c, err = await queue.get()
            if id(a) not in live:
                continue  # what came after its end
            if err is not None:
                raise err
            assert c is not None
            yield a, c
            if c.finished or a.out.stopped:
                live.pop(id(a)).cancel()
    finally:
        for t in live.values():
            t.cancel()


def tool_answer(body: Any, chat: bool, parser: str | None = None) -> ToolCallAnswer | None:
    """The answer's tool calls, when its ``tool_choice`` is not none (router/tool_calls.py);
    ``parser``: the cluster's ``tool_call_parser``, which ``auto`` needs (checked before)."""
    mode = body.tool_mode() if chat else None
    return ToolCallAnswer(*mode, parser=parser) if mode is not None else None


#: A token the engine sent no log probability for (it cannot happen with the shipped engines,
#: which send one per token when asked): listed with the floor value and no alternatives.
NO_LOGPROB: TokenLogprob = (MIN_LOGPROB, ())


def aligned(ids: list[int], lps: list[TokenLogprob]) -> list[TokenLogprob]:
    """``lps`` with one entry per id (``NO_LOGPROB`` for any missing). O(1) when they match."""
    return lps if len(lps) == len(ids) else (lps + [NO_LOGPROB] * (len(ids) - len(lps)))[: len(ids)]


class Output:
    """One answer's output as the client gets it, on any engine: the tokens detokenized
    incrementally, ended at the first stop token id (its text left out) or before the first
    stop string (``StopFilter``; with ``include_stop``, after it); neither counts among the first
    ``min_tokens`` tokens (vLLM's rule). O(chunk) per push, plus the stop strings' search."""

    def __init__(self, decode: Any, stops: list[str], stop_ids: list[int] | None, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.filter = StopFilter(stops, include_stop)
        self.stop_ids = frozenset(stop_ids or ())
        self.min_tokens = min_tokens
        self.ids: list[int] = []  # the output's token ids, to the stop token (included) when one ended it
        self.lps: list[TokenLogprob] = []  # their log probabilities, one per id, when the call asked
        self.stopped = False

    def push(self, c: TokenChunk) -> str:
        """The text ``c`` adds ('' once stopped)."""
        if self.stopped:
            return ""
        ids, final = c.token_ids, c.finished
        bar = min(len(ids), max(0, self.min_tokens - len(self.ids)))  # its first tokens that no stop may end
        at = next((j for j in range(bar, len(ids)) if ids[j] in self.stop_ids), -1) if self.stop_ids else -1
        counted = ids if at < 0 else ids[: at + 1]  # a stop token counts, its text is left out
        self.ids.extend(counted)
        if c.logprobs is not None:
            self.lps.extend(c.logprobs[: len(counted)])
        if at >= 0:
            ids, final, self.stopped = ids[:at], True, True
        text = ""
        if bar:  # the text of the answer's first min_tokens tokens: never searched for a stop string
            text = self.filter.push(self.detok.push(ids[:bar]), armed=False)
            ids = ids[bar:]
        rest = self.detok.push(ids)
        if final:
            rest += self.detok.finish()
        text += self.filter.push(rest, final=final)
        self.stopped = self.stopped or self.filter.stopped
        return text

    def finish_reason(self, last: TokenChunk) -> str:
        return "stop" if self.stopped else (last.finish_reason or "length")


class Answer:
    """One choice of an answer on its way back: its call and stream, its output as the client
    gets it (``Output``), its tool calls, its ``index`` among the choices, and the prompt text
    an ``echo`` puts first. A request has one per choice (prompts x ``n``). O(1) to build."""

    __slots__ = ("text_of", "call", "index", "echo", "out", "tools", "offset", "stream", "first", "last", "text")

    def __init__(self, tokenizer: Any, parser: str | None, call: GenerateCall, index: int, body: Any, chat: bool,
                 echo: str = "") -> None:
        # a log probability's token: its text, or vLLM's "token_id:<id>" (``return_tokens_as_token_ids``)
        self.text_of = token_id_text if body.return_tokens_as_token_ids else tokenizer.token_text
        self.call = call
        self.index = index
        self.echo = echo
        self.out = Output(tokenizer.decoder(body.skip_special_tokens), body.stop_strings(),
                          body.stop_token_ids, body.min_tokens, body.include_stop_str_in_output)
        self.tools = tool_answer(body, chat, parser)
        self.offset = 0  # a completion's text so far, for its tokens' text_offset
        self.stream: ReplicaStream | None = None
        self.first: TokenChunk | None = None
        self.last: TokenChunk | None = None
        self.text = ""  # a whole answer's output text

    def event(self, c: TokenChunk, body: Any, chat: bool, prefix: str = "",
              role: bool = False) -> dict[str, Any] | None:
        """The stream event's choice for chunk ``c``; None when it has nothing to say (a tool
        answer's held middle). O(chunk)."""
        out, call = self.out, self.call
        seen = len(out.ids)
        text = prefix + out.push(c)
        reason = out.finish_reason(c) if (c.finished or out.stopped) else None
        if chat:
            delta: dict[str, Any] | None
            if self.tools is not None:
                delta, reason = self.tools.delta(text, role, reason)
                if delta is None:  # held text; an event with a finish reason always goes
                    if call.logprobs is None and not body.return_token_ids and reason is None:
                        return None
                    delta = {}
            else:
                delta = {"content": text}
                if role:
                    delta["role"] = "assistant"
            ch: dict[str, Any] = {"index": self.index, "delta": delta, "finish_reason": reason}
            if call.logprobs is not None:
                ch["logprobs"] = chat_logprobs(self.text_of, out.ids[seen:], out.lps[seen:])
        else:
            lps = None
            if call.logprobs is not None:
                lps = text_logprobs(self.text_of, out.ids[seen:], out.lps[seen:], self.offset + len(prefix),
                                                  (call.prompt_token_ids, c.prompt_logprobs))
            self.offset += len(text)
            ch = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": reason}
        if body.return_token_ids:
            ch["token_ids"] = out.ids[seen:]
        return ch

    def whole(self, body: Any, chat: bool) -> dict[str, Any]:
        """A whole answer's choice. O(output)."""
        out, call, text = self.out, self.call, self.text
        assert self.first is not None and self.last is not None
        reason = out.finish_reason(self.last)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                message, reason = self.tools.message(text, reason)
            choice: dict[str, Any] = {"index": self.index, "message": message, "finish_reason": reason}
            if call.logprobs is not None:
                choice["logprobs"] = chat_logprobs(self.text_of, out.ids, out.lps)
        else:
            choice = {"index": self.index, "text": self.echo + text, "finish_reason": reason,
                      "logprobs": None if call.logprobs is None else text_logprobs(self.text_of,
                          out.ids, out.lps, len(self.echo), (call.prompt_token_ids, self.first.prompt_logprobs))}
            if call.prompt_logprobs is not None:  # each prompt's, on its choices, also for echo (vLLM's place)
                choice["prompt_logprobs"] = self.prompt_logprobs()
        if body.return_token_ids:
            choice["token_ids"] = out.ids
            choice["prompt_token_ids"] = call.prompt_token_ids
        return choice

    def prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` of this answer's prompt: per prompt token, None for the first
        (it has no context), else a map from token id to its log probability, rank and text: the
        prompt token's own first, then the alternatives asked for (ranks 1 and on). O(prompt x top)."""
        assert self.first is not None
        ids, entries = self.call.prompt_token_ids, self.first.prompt_logprobs or []
        text_of = self.text_of
        out: list[dict[str, dict[str, Any]] | None] = []
        for i, t in enumerate(ids):
            e = entries[i] if i < len(entries) else None
            if e is None:
                out.append(None)
                continue
            lp, top, rank = e
            m = {str(t): {"logprob": lp, "rank": rank, "decoded_token": text_of(t)}}
            for k, (a, v) in enumerate(top):
                m.setdefault(str(a), {"logprob": v, "rank": k + 1, "decoded_token": text_of(a)})
            out.append(m)
        return out


def token_id_text(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it in log probabilities: its id, for
    tokens whose text is not valid alone (part of a multi-byte character)."""
    return f"token_id:{token_id}"


def text_logprobs(text_of: Callable[[int], str], ids: list[int], lps: list[TokenLogprob], start: int,
                   prompt: tuple[list[int], list[PromptLogprob | None] | None]) -> dict[str, Any]:
    """A completion's ``logprobs`` for ``ids`` (OpenAI's legacy shape, as vLLM writes it): each
    token's text, log probability, top alternatives (None when none were asked for) and
    character offset from ``start``, the offsets adding up the tokens' own texts. ``prompt``:
    the prompt's ids and the chunk's prompt entries; when the chunk has them (echo with
    logprobs, on the first chunk) they come first, offsets from 0, the first token's log
    probability None (it has no context). O(tokens x top)."""
    def offsets_of(tokens: list[str], at: int) -> list[int]:
        out = []
        for tok in tokens:
            out.append(at)
            at += len(tok)
        return out

    entries: list[TokenLogprob | None] = list(aligned(ids, lps))
    tokens = [text_of(t) for t in ids]
    offsets = offsets_of(tokens, start)
    p_ids, p_entries = prompt
    if p_entries is not None:
        p_tokens = [text_of(t) for t in p_ids]
        tokens, offsets = p_tokens + tokens, offsets_of(p_tokens, 0) + offsets
        entries = (list(p_entries) + [None] * len(p_ids))[: len(p_ids)] + entries
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else ({text_of(t): v for t, v in e[1]} or None) for e in entries],
            "text_offset": offsets}

def chat_logprobs(text_of: Callable[[int], str], ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any]:
    """A chat answer's ``logprobs`` for ``ids``: OpenAI's ``content`` list, each token with its
    text, UTF-8 bytes, log probability and top alternatives. O(tokens x top)."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        tok = text_of(t)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                        for t, (lp, top) in zip(ids, aligned(ids, lps), strict=True)]}
