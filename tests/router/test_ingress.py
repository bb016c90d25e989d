"""The ingress's HTTP surface in-process: uvicorn serving the real FastAPI app on 127.0.0.1, with
a scripted replica handle behind it (no Ray), so hostile input can be thrown at it by the
thousand: limits (413, 408, 400), and hypothesis over bodies and headers: never a 5xx, never a
hang, always a JSON error that says what is wrong.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import router.ingress as ingress_mod
from fairway.policies.classes import ClassesConfig
from fairway.protocol import EngineFailed, Overloaded, TokenChunk
from router.auth import AuthArgs
from router.channels import StreamChannels
from router.cors import CorsArgs
from router.hold import HoldArgs
from router.ingress import FairwayIngress, IngressArgs, app
from router.limits import RequestLimits

MODEL = "fairway-tiny"


class ScriptedReplicas:
    """Stands in for the replicas' deployment handle: each call streams ``max_tokens`` tokens,
    one chunk each; ``cancelled`` counts calls the ingress cancelled."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.cancelled = 0
        self.open: set[int] = set()  # calls neither finished nor cancelled
        self.script: list[int] = []  # the token ids to stream, cycled (100 + i without one)
        self.refuse = 0  # this many calls (the first ones) are refused by "r0"'s full gate
        self.fail: set[int] = set()  # the calls (by their number in ``calls``) whose engine fails at their 2nd token
        self.finish = "length"  # the finish reason of a call's last chunk ("stop": the model ended it)
        self.token_delay_s = 0.001  # each token's wait (0: the next chunk at once, still yielding to the loop)
        # (expected first-token seconds, routing reason) set on each call as the request router does; None: not set
        self.routed: tuple[float, str] | None = None
        self.replica_ttft_s = 0.0  # the first chunk's TTFT as the replica measured it (0: not measured)

    def options(self, **_: Any) -> ScriptedReplicas:
        return self

    @property
    def generate(self) -> ScriptedReplicas:
        return self

    def remote(self, call: Any) -> _Gen:
        self.calls.append(call)
        if self.routed is not None:
            call.expected_ttft_s, call.routing_reason = self.routed
        gen = _Gen(self, call, refused=self.refuse > 0, fails=len(self.calls) - 1 in self.fail)
        self.refuse -= 1
        self.open.add(id(gen))
        return gen


def scripted_logprob(token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The scripted replicas' log probability of ``token`` and its ``top`` alternatives (the
    token itself first, then the next ids, each 1 less likely)."""
    lp = -0.25 * (token % 4)
    return lp, tuple((token + j, lp - j) for j in range(top))


def scripted_prompt_logprob(token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...], int]:
    """A prompt token's scripted entry: ``scripted_logprob``'s and a rank, 1 + token % 7."""
    return (*scripted_logprob(token, top), 1 + token % 7)


class _Gen:
    def __init__(self, owner: ScriptedReplicas, call: Any, refused: bool = False, fails: bool = False) -> None:
        self.owner = owner
        self.refused = refused
        self.fails = fails
        self.n = call.max_tokens
        self.i = 0
        self.ack = call.ack  # a held request's send: the gate says "queued" first
        self.prompt = len(call.prompt_token_ids)
        self.top = call.logprobs  # asked for log probabilities: scripted_logprob's, with this many alternatives
        # and the prompt's (echo with logprobs), on the first chunk: None for its first token
        self.prompt_lps = None if call.prompt_logprobs is None else [None] + [
            scripted_prompt_logprob(t, call.prompt_logprobs) for t in call.prompt_token_ids[1:]]

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> TokenChunk:
        if self.refused:
            self.owner.open.discard(id(self))
            raise Overloaded("replica r0 queue is full (max_queue)", retry_after_s=2.0, replica="r0")
        if self.ack:
            self.ack = False
            return TokenChunk(token_ids=[], accepted=True, replica="r0")
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        done = self.i == self.n
        await asyncio.sleep(self.owner.token_delay_s)
        if self.fails and self.i == 2:
            self.owner.open.discard(id(self))
            raise EngineFailed("scripted engine failure")
        if done:
            self.owner.open.discard(id(self))
        script = self.owner.script
        tok = script[(self.i - 1) % len(script)] if script else 100 + self.i
        return TokenChunk(token_ids=[tok], finished=done, finish_reason=self.owner.finish if done else None,
                          prompt_tokens=self.prompt, completion_tokens=self.i, replica="r0",
                          ttft_s=self.owner.replica_ttft_s if self.i == 1 else 0.0,
                          logprobs=None if self.top is None else [scripted_logprob(tok, self.top)],
                          prompt_logprobs=self.prompt_lps if self.i == 1 else None)

    def cancel(self) -> None:
        self.owner.cancelled += 1
        self.owner.open.discard(id(self))


class Server:
    """uvicorn serving ``app`` in a thread, on an ephemeral port."""

    def __init__(self, limits: RequestLimits, auth: AuthArgs | None = None, classes: str = "",
                 hold: HoldArgs | None = None, cors: CorsArgs | None = None) -> None:
        self.replicas = ScriptedReplicas()
        self.ingress = FairwayIngress(self.replicas, IngressArgs(model=MODEL, max_model_len=4096, metrics=False,
                                                                 limits=limits, auth=auth or AuthArgs(),
                                                                 classes=ClassesConfig.parse(classes),
                                                                 hold=hold or HoldArgs(), cors=cors or CorsArgs()))
        cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        # the app's routes and guards find this ingress as Serve's replica context would give it
        self._current = ingress_mod.current_ingress
        ingress_mod.current_ingress = lambda: self.ingress
        self.thread.start()
        deadline = time.monotonic() + 20
        while not (self.server.started and self.server.servers):
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        ingress_mod.current_ingress = self._current  # a server started before this one is current again


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server(RequestLimits(max_body_bytes=64 * 1024, body_timeout_s=1.0, max_messages=8)) as srv:
        yield srv


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = None,
         timeout: float = 10) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, timeout=timeout,
                         headers={"Content-Type": "application/json", **(headers or {})})


def assert_clear_error(r: requests.Response, status: int, needle: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and needle in err["message"], err


# -- limits ------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(server):
    big = {"model": MODEL, "prompt": "x " * 40_000, "max_tokens": 1}
    before = len(server.replicas.calls)
    assert_clear_error(post(server, "/v1/completions", big), 413, "limit is 65536 bytes")
    assert len(server.replicas.calls) == before  # nothing reached the replicas


def test_a_chunked_body_is_counted_as_it_arrives(server):
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "fairway-tiny", "prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    r = requests.post(server.url + "/v1/completions", data=chunks(), timeout=10,
                      headers={"Content-Type": "application/json"})
    assert_clear_error(r, 413, "exceeds the limit of 65536 bytes")


def test_a_slow_body_is_refused_with_408_and_the_connection_closed(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")  # then nothing: a slow-loris body
    t0 = time.monotonic()
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in reply
    assert time.monotonic() - t0 < 5


def test_too_many_messages_and_the_other_limits_are_400_with_the_reason(server):
    msgs = [{"role": "user", "content": "hi"}] * 9
    assert_clear_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs}), 400,
                       "too many messages: 9; the limit is 8")
    assert_clear_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}), 400,
                       "n: Input should be less than or equal to 128")
    before = len(server.replicas.calls)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 22})
    assert_clear_error(r, 400, "too many choices: 3 prompt(s) x n=22 = 66; the limit is 64 (limits.max_choices)")
    assert r.json()["error"]["param"] == "n"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [[5] * 10, [5] * 5000], "n": 2})
    assert_clear_error(r, 400, "maximum context length is 4096 tokens")  # one prompt too long: none is sent
    assert len(server.replicas.calls) == before
    assert_clear_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 10**9}),
                       400, "maximum context length is 4096 tokens")
    assert_clear_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [10**12]}), 400,
                       "out of the vocabulary")


def test_the_session_key_comes_from_the_header_else_the_user_field(server):
    body = {"model": MODEL, "prompt": [5] * 4, "max_tokens": 1}
    cases = [({"X-Session-Id": "conv-7"}, {"user": "u1"}, "conv-7"),  # the header wins
             ({"x-session-id": "conv-8"}, {}, "conv-8"),  # header names are case-insensitive
             ({}, {"user": "u1"}, "u1"),  # OpenAI's user field without the header
             ({}, {}, "")]  # neither: no session
    for headers, extra, want in cases:
        r = post(server, "/v1/completions", {**body, **extra}, headers=headers)
        assert r.status_code == 200, r.text
        assert server.replicas.calls[-1].session == want
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": "u2"}
    assert post(server, "/v1/chat/completions", chat, headers={"X-Session-Id": "c9"}).status_code == 200
    assert server.replicas.calls[-1].session == "c9"


def test_a_client_that_leaves_mid_stream_has_its_replica_call_cancelled(server):
    before = server.replicas.cancelled
    body = json.dumps({"model": MODEL, "prompt": [5] * 20, "max_tokens": 3000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    s.close()
    deadline = time.monotonic() + 10
    while server.replicas.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.replicas.cancelled == before + 1


def test_a_client_that_leaves_before_a_whole_answer_has_its_call_cancelled(server):
    """Without a stream, the HTTP server does not cancel the handler whose client left; the
    ingress watches for the disconnect itself and cancels the replica call at once."""
    before = server.replicas.cancelled
    body = json.dumps({"model": MODEL, "prompt": [5] * 20, "max_tokens": 3000}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.2)  # the call is under way (3,000 tokens take 3 s)
    s.close()
    t0 = time.monotonic()
    while server.replicas.cancelled == before and time.monotonic() < t0 + 10:
        time.sleep(0.01)
    assert server.replicas.cancelled == before + 1 and time.monotonic() - t0 < 1.0
    assert not server.replicas.open


# -- the front door: no prompt stalls the event loop -----------------------------------------


@pytest.fixture
def big_server() -> Iterator[Server]:
    """The default body limit (8 MiB), a 4,096-token context; for one test (the app is one
    global: the module's ``server`` is current again after it)."""
    with Server(RequestLimits()) as srv:
        yield srv


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def timed_post(server: Server, path: str, body: Any) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    r = post(server, path, body, timeout=60)
    return r, time.monotonic() - t0


def test_a_prompt_too_long_in_bytes_is_refused_at_once_without_tokenizing(big_server, monkeypatch):
    """A prompt just under the 8 MiB body limit is more bytes than 4,096 tokens can hold: 400
    naming the limit, without a tokenizer call, and a small request sent meanwhile is not held up.
    (Tokenizing it took 11-12 s inside the event loop before.) Bounds generous for a loaded box."""
    tok = big_server.ingress.tokenizer
    encoded: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a: encoded.append(len(text)) or real(text, *a))
    bound = big_server.ingress.max_text_bytes
    assert bound == 4096 * tok.max_token_bytes
    prompt = "word " * ((8 * 1024 * 1024 - 200) // 5)
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(timed_post, big_server, "/v1/completions", {"model": MODEL, "prompt": prompt})
        small = pool.submit(timed_post, big_server, "/v1/completions",
                            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True})
        (r_big, t_big), (r_small, t_small) = big.result(60), small.result(60)
    assert_clear_error(r_big, 400, f"at most {bound} bytes")
    assert "maximum context length is 4096 tokens" in r_big.json()["error"]["message"]
    assert r_small.status_code == 200 and r_small.text.endswith("data: [DONE]\n\n")
    assert t_big < 5.0 and t_small < 5.0, (t_big, t_small)
    assert len(prompt) not in encoded  # refused before any tokenization


@pytest.mark.parametrize("shape", ["members", "arrays", "batch"])
def test_a_body_of_many_json_elements_is_refused_with_413_before_it_is_parsed(big_server, monkeypatch, shape):
    """7.5 MB of JSON structure (a logit_bias of 600,000 ids, a schema of 1.9 million empty arrays,
    a batch of 1.5 million one-token prompts: 0.4, 1.2 and 3.3 s of the event loop to parse and
    validate before) is refused with 413 naming the bound, counted by its reason, and never parsed."""
    from bench.frontdoor import large_body
    from observability.stats import FairwayStats

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
    monkeypatch.setattr(big_server.ingress, "stats", stats)
    parsed: list[bytes] = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(s) or real(s, *a, **k))
    body = large_body(shape, 7.5)
    r = post(big_server, "/v1/completions", body)
    assert_clear_error(r, 413, "limits.max_parse_ms")
    assert stats.counter("rejects", reason="body_too_complex") == 1
    assert not any(len(p) == len(body) for p in parsed)


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_far_over_the_context_but_under_the_byte_bound_is_refused_from_a_prefix(big_server, monkeypatch,
                                                                                           chat):
    """A prompt under the byte bound but far over 4,096 tokens (about 1 MB of short words) is
    refused after tokenizing a prefix only: the whole text never reaches the tokenizer, and the
    400 gives a lower bound on its tokens."""
    tok = big_server.ingress.tokenizer
    seen: list[int] = []
    real = tok.tok

    def spy(text: str, **kw: Any) -> Any:
        seen.append(len(text))
        return real(text, **kw)

    monkeypatch.setattr(tok, "tok", spy)
    monkeypatch.setattr(tok, "encode_chat", lambda messages, *a, **k: pytest.fail("the whole chat was tokenized"))
    prompt = "a b " * 90_000  # 360 KB (under the byte bound), 180,000 tokens
    assert len(prompt.encode()) < big_server.ingress.max_text_bytes
    if chat:
        messages = [{"role": "user", "content": prompt}]
        r = post(big_server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    else:
        r = post(big_server, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert_clear_error(r, 400, "maximum context length is 4096 tokens. However, your prompt has at least")
    at_least = int(r.json()["error"]["message"].split("at least ")[1].split()[0])
    assert 4096 < at_least < 180_000
    assert seen and max(seen) <= 8 * 4096  # only the prefix was tokenized


def test_the_prefix_check_never_refuses_a_prompt_within_the_context(big_server):
    """Long texts with few tokens (long words, long runs of spaces) pass the prefix check when
    their whole tokenization fits, and the check's bound is a true lower bound."""
    from router.tokenizer import TooManyTokens

    tok = big_server.ingress.tokenizer
    for text in ("x" * 40_000, " " * 40_000, ("supercalifragilistic" * 20 + " ") * 100, "a b " * 9_000):
        n = len(tok.encode(text))
        for limit in (n, n + 1, max(1, n - 1), n // 2):
            try:
                tok.check_within(text, limit)
            except TooManyTokens as e:
                assert n > limit and e.at_least <= n, (text[:20], n, limit, e.at_least)


def test_a_prompt_being_tokenized_does_not_hold_up_other_clients(big_server, monkeypatch):
    """While a text prompt is inside the tokenizer (held there by the test, so nothing depends
    on timing), other clients' requests are answered: tokenization runs off the event loop.
    Then the held prompt finishes and gets its answer too."""
    tok = big_server.ingress.tokenizer
    inside, release = threading.Event(), threading.Event()
    real = tok.encode

    def held(text: str, *a: Any) -> list[int]:
        if text.startswith("HOLD"):
            inside.set()
            assert release.wait(30)
        return real(text, *a)

    monkeypatch.setattr(tok, "encode", held)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, big_server, "/v1/completions",
                          {"model": MODEL, "prompt": "HOLD " + "x y " * 3_000, "max_tokens": 1}, None, 60)
        wait_for(inside.is_set, 20, "the held prompt to reach the tokenizer")
        for stream in (False, True):
            r = post(big_server, "/v1/completions",
                     {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream}, timeout=10)
            assert r.status_code == 200, r.text
        assert not big.done()
        release.set()
        r_big = big.result(30)
    assert_clear_error(r_big, 400, "maximum context length is 4096 tokens")


# -- OpenAI parameters: honoured or refused by name, never ignored --------------------------

WORDS = " alpha beta gamma delta epsilon zeta"


def _text(r: requests.Response, chat: bool, stream: bool) -> tuple[str, str | None]:
    """The answer's text and finish reason, from a whole answer or the stream's frames."""
    if not stream:
        ch = r.json()["choices"][0]
        return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
    text, reason = "", None
    for ln in r.text.split("\n"):
        if ln.startswith("data: {"):
            for ch in json.loads(ln[6:])["choices"]:
                text += ch["delta"].get("content", "") if chat else ch["text"]
                reason = ch["finish_reason"] or reason
    return text, reason


def _call_has(**want: Any) -> Callable[[Server, dict, bool, bool], None]:
    def check(server: Server, body: dict, chat: bool, stream: bool) -> None:
        call = server.replicas.calls[-1]
        assert {k: getattr(call, k) for k in want} == want

    return check


def _stops_before(word: str) -> Callable[[Server, dict, bool, bool], None]:
    """The text ends just before ``word`` (WORDS's text) with finish "stop", and the usage counts
    the tokens up to the stop, not max_tokens."""
    def check(server: Server, body: dict, chat: bool, stream: bool) -> None:
        r = post(server, "/v1/chat/completions" if chat else "/v1/completions", {**body, "stream": stream})
        text, reason = _text(r, chat, stream)
        assert (text, reason) == (WORDS[: WORDS.index(word)], "stop"), (text, reason)
        if not stream:
            n = len(server.ingress.tokenizer.encode(WORDS[: WORDS.index(word) + len(word)]))
            assert r.json()["usage"]["completion_tokens"] <= n < body["max_tokens"]

    return check


def _keeps_the_stop(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """include_stop_str_in_output: the text ends with the stop string that ended it."""
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions",
             {**body, "stop": ["gamma"], "stream": stream})
    assert _text(r, chat, stream) == (WORDS[: WORDS.index("gamma") + len("gamma")], "stop")


def _min_tokens_bar_stops(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """min_tokens k: a stop string or stop token within the first k tokens ends nothing (vLLM's
    rule); the first one past them does. Here "alpha" (and its token) ends in the first k tokens,
    "gamma" after them."""
    tok = server.ingress.tokenizer
    ids = tok.encode(WORDS)
    assert body["min_tokens"] == next(k for k in range(1, len(ids)) if "alpha" in tok.decode(ids[:k]))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = post(server, path, {**body, "stop": ["alpha", "gamma"], "stream": stream})
    assert _text(r, chat, stream) == (WORDS[: WORDS.index("gamma")], "stop")
    assert server.replicas.calls[-1].min_tokens == body["min_tokens"]
    r = post(server, path, {**body, "stop_token_ids": [ids[0]], "stream": stream})  # inside the bar: no stop
    assert _text(r, chat, stream) == (WORDS, "length")
    r = post(server, path, {**body, "min_tokens": body["max_tokens"] + 1, "stream": stream})
    assert_clear_error(r, 400, "min_tokens")
    assert r.json()["error"]["param"] == "min_tokens"


def _choices(server: Server, body: dict, chat: bool, stream: bool, prompts: list) -> None:
    """Each prompt's n choices were sent as their own calls (prompt x n of them, each with its
    own request id, a seed's choices seed + i) and come back indexed prompt x n + i, each the
    whole output; the usage counts each prompt once and every choice's completion."""
    n = body.get("n", 1)
    k = len(prompts) * n
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", {**body, "stream": stream,
                                                                              "stream_options": {"include_usage":
                                                                                                 True}} if stream
             else {**body, "stream": False})
    assert r.status_code == 200, r.text
    calls = server.replicas.calls[-k:]
    assert len({c.request_id for c in calls}) == k
    if body.get("seed") is not None:
        assert [c.seed for c in calls] == [body["seed"] + i for _ in prompts for i in range(n)]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    events = [r.json()] if not stream else [json.loads(ln[6:]) for ln in r.text.split("\n")
                                            if ln.startswith("data: {")]
    for e in events:
        for ch in e["choices"]:
            piece = (ch["message"]["content"] if not stream else ch["delta"].get("content", "")) if chat else ch["text"]
            texts[ch["index"]] = texts.get(ch["index"], "") + piece
            if ch["finish_reason"]:
                assert ch["index"] not in reasons, "a choice finished twice"
                reasons[ch["index"]] = ch["finish_reason"]
    echo = body.get("echo")
    assert texts == {p * n + i: ((prompts[p] if echo else "") + WORDS) for p in range(len(prompts)) for i in range(n)}
    assert reasons == dict.fromkeys(range(k), "length")
    usage = events[-1]["usage"]
    per_prompt = [len(c.prompt_token_ids) for c in calls[::n]]
    assert usage["prompt_tokens"] == sum(per_prompt) and usage["completion_tokens"] == k * body["max_tokens"]


def test_n_choices_and_a_batch_of_prompts_are_one_call_each_answered_as_one(server):
    """n > 1 on both routes, a completion's batch of prompts, and both at once, whole and
    streamed (with usage), with echo and a seed."""
    tok = server.ingress.tokenizer
    server.replicas.script = tok.encode(WORDS)
    n_ids = len(tok.encode(WORDS))
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n_ids, "seed": 7}
        comp = {"model": MODEL, "prompt": ["one", "two two"], "max_tokens": n_ids, "echo": True}
        for stream in (False, True):
            _choices(server, {**chat, "n": 3}, True, stream, ["hi"])
            _choices(server, {**comp, "n": 2, "seed": 11}, False, stream, ["one", "two two"])
            _choices(server, {**comp, "prompt": [[5, 6], [7]]}, False, stream, [tok.decode([5, 6]), tok.decode([7])])
        assert server.replicas.open == set()  # every call ended
    finally:
        server.replicas.script = []


def test_when_one_choice_fails_the_others_are_cancelled(server):
    """A choice whose engine fails ends the whole request with its error (a 503 before the
    answer, an error event in a stream), and the other choices' calls are cancelled at once."""
    body = {"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 2000}
    for stream in (False, True):
        server.replicas.fail = {len(server.replicas.calls) + 1}  # the second choice's call
        cancelled = server.replicas.cancelled
        try:
            r = post(server, "/v1/completions", {**body, "stream": stream})
        finally:
            server.replicas.fail = set()
        if stream:
            assert r.status_code == 200 and "scripted engine failure" in r.text and r.text.endswith("[DONE]\n\n")
        else:
            assert_clear_error(r, 503, "scripted engine failure")
        deadline = time.monotonic() + 5
        while server.replicas.open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.replicas.open == set() and server.replicas.cancelled == cancelled + 2


def _echoes(server: Server, body: dict, chat: bool, stream: bool) -> None:
    r = post(server, "/v1/completions", {**body, "stream": stream})
    text, _ = _text(r, chat, stream)
    assert text == "hi" + WORDS


def _logprob_entries(r: requests.Response, chat: bool, stream: bool) -> list[tuple[str, float, list]]:
    """(token, logprob, top alternatives as (token, logprob)) per output token, from a whole
    answer's or a stream's ``logprobs``."""
    chunks = [r.json()["choices"][0]["logprobs"]] if not stream else [
        ch["logprobs"] for ln in r.text.split("\n") if ln.startswith("data: {")
        for ch in json.loads(ln[6:])["choices"]]
    out = []
    for lp in chunks:
        if chat:
            out += [(e["token"], e["logprob"], [(a["token"], a["logprob"]) for a in e["top_logprobs"]])
                    for e in lp["content"]]
        else:
            out += [(t, v, list((top or {}).items())) for t, v, top in
                    zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
    return out


def _has_logprobs(server: Server, body: dict, chat: bool, stream: bool, top: int) -> None:
    """The call asked the engine for ``top`` alternatives, and the answer lists each output
    token's log probability as the engine sent it, in the API's own shape."""
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", {**body, "stream": stream})
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].logprobs == top
    text_of = server.ingress.tokenizer.token_text
    want = [(text_of(t), scripted_logprob(t, top)[0],
             [(text_of(a), v) for a, v in scripted_logprob(t, top)[1]]) for t in server.ingress.tokenizer.encode(WORDS)]
    assert _logprob_entries(r, chat, stream) == want


def _session(key: str) -> Callable[[Server, dict, bool, bool], None]:
    return _call_has(session=key)


def _no_effect(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """Accepted and documented as changing no output (the answer is the plain one)."""
    text, reason = _text(post(server, "/v1/chat/completions" if chat else "/v1/completions", body), chat, False)
    assert (text, reason) == (WORDS, "length")


def _tool_calls(r: requests.Response, stream: bool) -> tuple[list[dict], str | None, str | None]:
    """(tool calls, content, finish reason) of a chat answer; a stream's deltas put together as
    OpenAI's client does (by index: id, type and name once, arguments appended)."""
    if not stream:
        ch = r.json()["choices"][0]
        return ch["message"].get("tool_calls") or [], ch["message"]["content"], ch["finish_reason"]
    calls: dict[int, dict] = {}
    content, reason = None, None
    for ln in r.text.split("\n"):
        if ln.startswith("data: {"):
            for ch in json.loads(ln[6:])["choices"]:
                if "content" in ch["delta"]:
                    content = (content or "") + ch["delta"]["content"]
                for d in ch["delta"].get("tool_calls", ()):
                    c = calls.setdefault(d["index"], {"function": {"arguments": ""}})
                    for k in ("id", "type"):
                        if k in d:
                            assert k not in c, f"{k} sent twice"
                            c[k] = d[k]
                    if "name" in d.get("function", {}):
                        c["function"]["name"] = d["function"]["name"]
                    c["function"]["arguments"] += d.get("function", {}).get("arguments", "")
                reason = ch["finish_reason"] or reason
    return [calls[i] for i in sorted(calls)], content, reason


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _tools_in_prompt(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """The tools reached the chat template (their JSON is in the prompt) and the answer is text."""
    prompt = server.ingress.tokenizer.decode(server.replicas.calls[-1].prompt_token_ids)
    assert json.dumps(TOOLS[0]) in prompt and server.replicas.calls[-1].structured_output is None
    _no_effect(server, body, chat, stream)


def _named_call(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """The output is constrained to the named function's arguments and answered as its call."""
    assert server.replicas.calls[-1].structured_output == {"json": WEATHER}
    assert server.replicas.calls[-1].structured_output_param == "tool_choice"
    calls, content, reason = _tool_calls(post(server, "/v1/chat/completions", {**body, "stream": stream}), stream)
    assert [(c["type"], c["function"]) for c in calls] == [("function", {"name": "get_weather", "arguments": WORDS})]
    assert calls[0]["id"].startswith("call_") and content is None and reason == "length"


def _prompt_is(template: dict[str, Any]) -> Callable[[Server, dict, bool, bool], None]:
    """The chat's prompt was rendered with these chat template options (and the answer is the
    plain one)."""
    def check(server: Server, body: dict, chat: bool, stream: bool) -> None:
        tok = server.ingress.tokenizer
        want = tok.encode_chat(body["messages"], template=template)
        assert server.replicas.calls[-1].prompt_token_ids == want != tok.encode_chat(body["messages"]), template
        _no_effect(server, body, chat, stream)
    return check


PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]


def _prompt_ids(server: Server, body: dict, chat: bool) -> list[int]:
    """The ids of ``body``'s prompt as the tokenizer gives them, with ``add_special_tokens`` as the
    body says (vLLM's defaults: true for a completion's text, false for a chat)."""
    tok = server.ingress.tokenizer
    if chat:
        return tok.encode_chat(body["messages"], add_special_tokens=body.get("add_special_tokens", False))
    return tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))


def _sends_prompt(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """The call's prompt is the tokenizer's with the body's ``add_special_tokens``, and the answer
    the plain one (test_add_special_tokens_* shows a tokenizer that adds one)."""
    assert server.replicas.calls[-1].prompt_token_ids == _prompt_ids(server, body, chat)
    _no_effect(server, body, chat, stream)


def _keeps(side: str) -> Callable[[Server, dict, bool, bool], None]:
    """truncate_prompt_tokens: the call has the prompt's first ("right") or last ("left", the
    default) tokens (test_truncate_prompt_tokens_* below on long prompts)."""
    def check(server: Server, body: dict, chat: bool, stream: bool) -> None:
        from router.tokenizer import kept

        want = kept(_prompt_ids(server, body, chat), (body["truncate_prompt_tokens"], side))
        assert server.replicas.calls[-1].prompt_token_ids == want and len(want) == 1
    return check


def _lists_prompt_logprobs(server: Server, body: dict, chat: bool, top: int) -> None:
    """vLLM's prompt_logprobs: the call asks the engine for the prompt's log probabilities with
    ``top`` alternatives, and the answer lists them in vLLM's shape (on the completion's choice,
    on the chat's response): None for the first token, then token id -> logprob, rank, text, the
    prompt token's own first."""
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    call = server.replicas.calls[-1]
    assert r.status_code == 200 and call.prompt_logprobs == top, r.text
    got = r.json()["prompt_logprobs"] if chat else r.json()["choices"][0]["prompt_logprobs"]
    text_of = server.ingress.tokenizer.token_text
    want: list = [None]
    for t in call.prompt_token_ids[1:]:
        lp, alts, rank = scripted_prompt_logprob(t, top)
        m = {str(t): {"logprob": lp, "rank": rank, "decoded_token": text_of(t)}}
        for k, (a, v) in enumerate(alts):
            m.setdefault(str(a), {"logprob": v, "rank": k + 1, "decoded_token": text_of(a)})
        want.append(m)
    assert got == want


def _keeps_special_tokens(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """skip_special_tokens false: an output special token's text stays in the answer (by default
    it is left out)."""
    tok = server.ingress.tokenizer
    server.replicas.script = tok.encode(WORDS) + [tok.eos_token_id]
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        n = len(server.replicas.script)
        for skip, want in ((False, WORDS + tok.tok.eos_token), (True, WORDS)):
            r = post(server, path, {**body, "max_tokens": n, "skip_special_tokens": skip, "stream": stream})
            assert _text(r, chat, stream) == (want, "length")
    finally:
        server.replicas.script = tok.encode(WORDS)


def _names_token_ids(server: Server, body: dict, chat: bool, stream: bool) -> None:
    """return_tokens_as_token_ids: log probabilities name each token and alternative by its id."""
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions",
             {**body, "logprobs": True if chat else 1, "stream": stream})
    want = [(f"token_id:{t}", scripted_logprob(t, 1 - chat)[0],
             [(f"token_id:{a}", v) for a, v in scripted_logprob(t, 1 - chat)[1]])
            for t in server.ingress.tokenizer.encode(WORDS)]
    assert _logprob_entries(r, chat, stream) == want


class Needs(NamedTuple):
    """A field refused alone (a 400 naming ``param``, saying ``why``) that is honoured with
    ``extra`` fields (then checked by ``then``)."""

    param: str
    why: str
    extra: dict
    then: Callable[[Server, dict, bool, bool], None]


REFUSE = "400"
YES_NO = {"type": "string", "enum": ["yes", "no"]}
STREAM_ONLY = "stream only"  # 200 with stream=True, a 400 naming the field with stream=False


class WholeOnly(NamedTuple):
    """A field honoured in a whole answer (checked by ``then``) and refused on a stream with a 400
    naming it."""

    then: Callable[[Server, dict, bool, bool], None]
#: Every field of the request models: (value to send, REFUSE or a check that it was honoured).
#: Values that are the field's no-op default are accepted by both; the matrix sends a real use.
COMMON: dict[str, tuple[Any, Any]] = {
    "model": (MODEL, _no_effect),
    "max_tokens": (3, lambda srv, b, c, s: srv.replicas.calls[-1].max_tokens == 3 or pytest.fail("max_tokens")),
    "stream": (True, lambda srv, b, c, s: None),  # the stream=True runs of every check
    # honoured on a stream (test_include_usage_* below), refused by name without one
    "stream_options": ({"include_usage": True}, STREAM_ONLY),
    "temperature": (0.0, _call_has(temperature=0.0)),
    "top_p": (0.5, _call_has(top_p=0.5)),
    "top_k": (5, _call_has(top_k=5)),
    "min_p": (0.1, _call_has(min_p=0.1)),
    "n": (2, lambda srv, b, c, s: _choices(srv, b, c, s, ["hi"])),
    "stop": (["gamma", "zeta"], _stops_before("gamma")),
    "stop_token_ids": (None, None),  # filled per tokenizer below
    "min_tokens": (None, _min_tokens_bar_stops),  # the token count of " alpha": filled per tokenizer below
    "include_stop_str_in_output": (True, _keeps_the_stop),
    "seed": (7, _call_has(seed=7)),
    "frequency_penalty": (0.5, _call_has(frequency_penalty=0.5)),  # the engine decides (sim refuses)
    "presence_penalty": (0.5, _call_has(presence_penalty=0.5)),
    "repetition_penalty": (1.2, _call_has(repetition_penalty=1.2)),
    "logit_bias": ({"42": 5}, _call_has(logit_bias={42: 5.0})),
    "ignore_eos": (True, _call_has(ignore_eos=True)),
    "return_token_ids": (True, lambda srv, b, c, s: None),  # test_the_other_tests... token ids below
    "cache_salt": ("s1", _call_has(cache_salt="s1")),
    "user": ("u9", _session("u9")),
    "safety_identifier": ("sid", _no_effect),
    "prompt_cache_key": ("pk", _session("pk")),
    "priority": (1, REFUSE),  # no classes configured on this server: only 0; the classes test below honours it
    "best_of": (2, REFUSE),
    "logprobs": (1, lambda srv, b, c, s: _has_logprobs(srv, b, c, s, 1)),
    "structured_outputs": ({"choice": ["yes", "no"]}, _call_has(structured_output={"choice": ["yes", "no"]},
                                                                 structured_output_param="structured_outputs")),
    "truncate_prompt_tokens": (1, _keeps("left")),  # the last tokens by default, as vLLM's
    "truncation_side": ("right", Needs("truncation_side", "truncation_side goes with truncate_prompt_tokens",
                                       {"truncate_prompt_tokens": 1}, _keeps("right"))),
    "skip_special_tokens": (False, _keeps_special_tokens),
    "spaces_between_special_tokens": (False, REFUSE),
    "return_tokens_as_token_ids": (True, _names_token_ids),
    "allowed_token_ids": ([42, 43], _call_has(allowed_token_ids=(42, 43))),  # the engine's (sim: test_sim_engine)
    "bad_words": (["gamma"], _call_has(bad_words=("gamma",))),  # the engine's (the sim engine refuses them)
    "prompt_logprobs": (2, WholeOnly(lambda srv, b, c, s: _lists_prompt_logprobs(srv, b, c, 2))),
}
COMPLETION = {**COMMON, "prompt": ("hi", _no_effect), "echo": (True, _echoes), "suffix": ("end", REFUSE),
              "add_special_tokens": (False, _sends_prompt)}
CHAT = {**COMMON, "messages": ([{"role": "user", "content": "hi"}], _no_effect),
        "add_special_tokens": (True, _sends_prompt),
        "logprobs": (True, lambda srv, b, c, s: _has_logprobs(srv, b, c, s, 0)),
        "max_completion_tokens": (3, lambda srv, b, c, s: srv.replicas.calls[-1].max_tokens == 3 or pytest.fail()),
        "top_logprobs": (2, REFUSE),  # alone: it needs logprobs: true (test_logprobs_* below)
        "response_format": ({"type": "json_schema", "json_schema": {"name": "yn", "schema": YES_NO}},
                            _call_has(structured_output={"json": YES_NO})),
        # alone, tools default tool_choice to auto, which needs a tool-call parser: refused by name
        "tools": (TOOLS, Needs("tool_choice", "tool_choice 'auto'", {"tool_choice": "none"}, _tools_in_prompt)),
        "tool_choice": (NAMED, Needs("tool_choice", "tool_choice needs tools", {"tools": TOOLS}, _named_call)),
        "functions": ([{"name": "f"}], REFUSE), "function_call": ("auto", REFUSE),
        "parallel_tool_calls": (False, _no_effect), "audio": ({"voice": "alloy", "format": "wav"}, REFUSE),
        "modalities": (["text", "audio"], REFUSE), "prediction": ({"type": "content", "content": "x"}, REFUSE),
        "web_search_options": ({}, REFUSE), "moderation": ({"model": "m"}, REFUSE),
        "reasoning_effort": ("high", REFUSE), "verbosity": ("low", REFUSE), "store": (True, REFUSE),
        "metadata": ({"k": "v"}, REFUSE), "service_tier": ("flex", REFUSE), "prompt_cache_retention": ("24h", REFUSE),
        "prompt_cache_options": ({"mode": "explicit"}, REFUSE),
        "add_generation_prompt": (False, _prompt_is({"add_generation_prompt": False})),
        # alone, the last message is the user's: nothing to continue
        "continue_final_message": (True, Needs(None, "continue_final_message continues the last message, which must "
                                               "be an assistant's", {"messages": PREFILL},
                                               _prompt_is({"add_generation_prompt": False,
                                                           "continue_final_message": True}))),
        # the variables reach the template (test_chat_template_kwargs_... below); this template uses none
        "chat_template_kwargs": ({"enable_thinking": False}, _no_effect)}


def test_structured_outputs_take_one_kind_and_do_not_share_the_answer_with_another_constraint(server):
    """vLLM's ``structured_outputs`` pass to the call as they come (``json`` by its name), one kind
    at a time, and never beside a JSON ``response_format`` or a forced tool call: 400s naming the
    field; on the sim engine they are refused by name (``tests/replicas/engines/test_sim_engine.py``)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", {**chat, "structured_outputs": {"json": YES_NO,
                                                                             "disable_any_whitespace": True}})
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].structured_output == {"json": YES_NO, "disable_any_whitespace": True}
    for so, why in (({"regex": "a", "choice": ["a"]}, "exactly one kind of constraint"),
                    ({}, "exactly one kind of constraint (json, regex, choice, grammar, json_object, "
                         "structural_tag), not none"),
                    ({"choice": []}, "at least 1 item"), ({"guided": "x"}, "guided")):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": so})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"].startswith("structured_outputs"), r.json()
    both = {**chat, "structured_outputs": {"regex": "a+"}}
    r = post(server, "/v1/chat/completions", {**both, "response_format": {"type": "json_object"}})
    assert_clear_error(r, 400, "a JSON response_format and structured_outputs cannot both shape the answer")
    r = post(server, "/v1/chat/completions", {**both, "tools": TOOLS, "tool_choice": "required"})
    assert_clear_error(r, 400, "a tool_choice that forces a call and structured_outputs cannot both")
    r = post(server, "/v1/chat/completions", {**both, "response_format": {"type": "text"}})
    assert r.status_code == 200 and server.replicas.calls[-1].structured_output == {"regex": "a+"}


def test_chat_template_kwargs_reach_the_template_and_may_not_set_the_servers_own(server, monkeypatch):
    """``chat_template_kwargs`` are the template's variables (a template that reads one renders
    it); names the server sets, and a prompt-continuing request that also asks for the assistant's
    header, are 400s naming the field."""
    tok = server.ingress.tokenizer
    monkeypatch.setattr(tok.tok, "chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"
                                                  "{% if enable_thinking %}<think>{% endif %}")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for kwargs, tail in (({"enable_thinking": True}, "<think>"), ({"enable_thinking": False}, ""), (None, "")):
        r = post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        assert tok.decode_all(server.replicas.calls[-1].prompt_token_ids) == "hi" + tail
    r = post(server, "/tokenize", {"messages": chat["messages"], "chat_template_kwargs": {"enable_thinking": True}})
    assert tok.decode_all(r.json()["tokens"]) == "hi<think>"
    for bad, why in (({"tools": []}, "['tools'] are set by the server or by their own request fields"),
                     ({"add_generation_prompt": False, "tokenize": False}, "['add_generation_prompt', 'tokenize']")):
        r = post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": bad})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] == "chat_template_kwargs"
    r = post(server, "/v1/chat/completions", {**chat, "messages": PREFILL, "continue_final_message": True,
                                             "add_generation_prompt": True})
    assert_clear_error(r, 400, "continue_final_message and add_generation_prompt cannot both be true")
    r = post(server, "/tokenize", {"prompt": "hi", "chat_template_kwargs": {"x": 1}})
    assert_clear_error(r, 400, "chat_template_kwargs go with messages, not a prompt")


def test_logprobs_list_one_entry_per_counted_token_with_the_asked_alternatives_or_a_400(server):
    """Chat's logprobs / top_logprobs and a completion's logprobs reach the call as the number of
    alternatives; the answer lists one entry per output token the usage counts (a stop token id
    included, as in ``token_ids``), with the text offsets adding up the tokens' texts; with echo,
    the prompt's tokens first; what the API does not allow is a 400 naming the field."""
    tok = server.ingress.tokenizer
    ids = tok.encode(WORDS)
    server.replicas.script = ids
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids)}
    try:
        r = post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert server.replicas.calls[-1].logprobs == 2 and len(content) == len(ids)
        assert all(len(e["top_logprobs"]) == 2 and bytes(e["bytes"]) == e["token"].encode() for e in content)
        assert "logprobs" not in post(server, "/v1/chat/completions", chat).json()["choices"][0]
        body = {"model": MODEL, "prompt": "hi", "max_tokens": len(ids), "logprobs": 3, "stop_token_ids": [ids[5]]}
        r = post(server, "/v1/completions", body)
        lp, usage = r.json()["choices"][0]["logprobs"], r.json()["usage"]
        assert len(lp["tokens"]) == usage["completion_tokens"] == 6 and lp["tokens"][-1] == tok.token_text(ids[5])
        assert all(len(top) == 3 for top in lp["top_logprobs"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
        r = post(server, "/v1/completions", {**body, "logprobs": 0, "stream": True})
        assert [e[2] for e in _logprob_entries(r, False, True)] == [[]] * 6  # no alternatives asked for
        assert post(server, "/v1/completions", {**body, "logprobs": None}).json()["choices"][0]["logprobs"] is None
        # echo with logprobs (scoring, as evaluation harnesses ask): the prompt's tokens first, the
        # first without a log probability, then the output's; whole and streamed alike
        prompt = tok.encode("hi there")
        score = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True}
        want = ([tok.token_text(t) for t in prompt + ids[:1]],
                [None] + [scripted_logprob(t, 1)[0] for t in prompt[1:] + ids[:1]])
        for stream in (False, True):
            r = post(server, "/v1/completions", {**score, "stream": stream})
            assert server.replicas.calls[-1].prompt_logprobs == 1
            lp = r.json()["choices"][0]["logprobs"] if not stream else json.loads(
                r.text.split("\n")[0][6:])["choices"][0]["logprobs"]
            assert (lp["tokens"], lp["token_logprobs"]) == want and lp["top_logprobs"][0] is None
            if not stream:  # and vLLM's prompt_logprobs beside, as its server answers echo with logprobs
                plp = r.json()["choices"][0]["prompt_logprobs"]
                assert plp[0] is None and [e[str(t)]["logprob"] for t, e in zip(prompt[1:], plp[1:], strict=True)] \
                    == want[1][1:len(prompt)]
            assert lp["text_offset"][: len(prompt)] == [sum(len(t) for t in want[0][:i]) for i in range(len(prompt))]
        assert post(server, "/v1/completions", body).status_code == 200
        assert server.replicas.calls[-1].prompt_logprobs is None  # without echo: the output's only
    finally:
        server.replicas.script = []
    for path, extra, param, why in (
            ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
            ("/v1/chat/completions", {"logprobs": 2}, "logprobs", "logprobs is true or false"),
            ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "or equal to 20"),
            ("/v1/completions", {"logprobs": 21}, "logprobs", "0 to 20"),
            ("/v1/completions", {"logprobs": True}, "logprobs", "0 to 20")):
        base = chat if "chat" in path else {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = post(server, path, {**base, **extra})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] == param


def test_response_format_becomes_the_calls_output_constraint_or_a_400_naming_what_is_wrong(server):
    """OpenAI's response_format as vLLM's own server maps it (text: none; json_object; json_schema:
    its schema); a malformed one is a 400 naming response_format and what is wrong."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for rf, want in (({"type": "text"}, None), ({"type": "json_object"}, {"json_object": True}),
                     ({"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}},
                      {"json": {"type": "object"}}),
                     ({"type": "json_schema", "json_schema": {"name": "o"}}, {"json": {}})):
        assert post(server, "/v1/chat/completions", {**chat, "response_format": rf}).status_code == 200
        assert server.replicas.calls[-1].structured_output == want, rf
    for rf, why in (({"type": "xml"}, "type 'xml' is not supported; use text, json_object or json_schema"),
                    ({"type": "json_schema"}, "needs a json_schema object with a name"),
                    ({"type": "json_schema", "json_schema": {"schema": {}}}, "needs a json_schema object with a name"),
                    ({"type": "json_schema", "json_schema": {"name": "o", "schema": [1]}}, "must be a JSON Schema")):
        r = post(server, "/v1/chat/completions", {**chat, "response_format": rf})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_request_field_is_honoured_or_refused_by_name(server, chat):
    """The parameter matrix: every field of the request model is in the table (a new field
    without a row fails here), and each is either honoured (checked on the output or on the
    replica call) or refused with a 400 naming it; an unknown field is a 400 naming it too."""
    from router.openai_api import ChatCompletionRequest, CompletionRequest

    tok = server.ingress.tokenizer
    table = dict(CHAT if chat else COMPLETION)
    ids = tok.encode(WORDS)
    k = next(k for k in range(len(ids)) if len(tok.decode(ids[: k + 1])) > WORDS.index(" gamma"))
    assert tok.decode(ids[:k]) == WORDS[: WORDS.index(" gamma")] and ids[k] not in ids[:k]
    table["stop_token_ids"] = ([ids[k]], _stops_before(tok.decode(ids[k:k + 1])))
    table["min_tokens"] = (next(k for k in range(1, len(ids)) if "alpha" in tok.decode(ids[:k])), _min_tokens_bar_stops)
    model = ChatCompletionRequest if chat else CompletionRequest
    assert set(table) == set(model.model_fields)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": MODEL, "max_tokens": len(ids), **({"messages": [{"role": "user", "content": "hi"}]} if chat
                                                   else {"prompt": "hi"})}
    server.replicas.script = tok.encode(WORDS)
    try:
        for name, (value, expect) in table.items():
            body = {**base, name: value}
            if isinstance(expect, Needs):
                r = post(server, path, body)
                assert_clear_error(r, 400, expect.why)
                assert r.json()["error"]["param"] == expect.param
                body, expect = {**body, **expect.extra}, expect.then
            if expect == REFUSE:
                r = post(server, path, body)
                assert_clear_error(r, 400, name)
                assert r.json()["error"]["param"] == name
                continue
            if isinstance(expect, WholeOnly):
                r = post(server, path, {**body, "stream": True})
                assert_clear_error(r, 400, name)
                assert r.json()["error"]["param"] == name
                assert post(server, path, {**body, "stream": False}).status_code == 200
                expect.then(server, body, chat, False)
                continue
            if expect == STREAM_ONLY:
                r = post(server, path, {**body, "stream": False})
                assert_clear_error(r, 400, name)
                assert r.json()["error"]["param"] == name
                assert post(server, path, {**body, "stream": True}).status_code == 200
                continue
            for stream in (False, True):
                r = post(server, path, {**body, "stream": stream})
                assert r.status_code == 200, (name, r.text)
                expect(server, body, chat, stream)
        r = post(server, path, {**base, "frobnicate": 1})
        assert_clear_error(r, 400, "frobnicate: Extra inputs are not permitted")
    finally:
        server.replicas.script = []


class SimReplicas:
    """The replicas' handle as one real replica in-process (``replicas/deployment.py``'s
    ``FairwayReplica``: the sim engine behind its gate, started in the server's event loop on
    the first call), so the parameters meet the engine that honours or refuses them."""

    def __init__(self) -> None:
        self.replica: Any = None
        self.calls: list[Any] = []

    def options(self, **_: Any) -> SimReplicas:
        return self

    @property
    def generate(self) -> SimReplicas:
        return self

    async def started(self) -> Any:
        if self.replica is None:
            from replicas.deployment import FairwayReplica

            rep = object.__new__(FairwayReplica)
            await FairwayReplica.__init__(rep, {"engine": "sim", "metrics": False, "stream_interval_s": 0,
                                                "engine_args": {"speed": 1000.0, "max_model_len": 4096}})
            self.replica = rep
        return self.replica

    def remote(self, call: Any) -> _SimGen:
        self.calls.append(call)
        return _SimGen(self, call)

    async def open_channel(self, call: Any) -> Any:
        """The replica's stream channel (``FairwayReplica.channel``), as the handle's call gives it."""
        async for batch in (await self.started()).channel(call):
            yield batch


class _SimGen:
    def __init__(self, owner: SimReplicas, call: Any) -> None:
        self.owner, self.call, self.it = owner, call, None

    def __aiter__(self) -> _SimGen:
        return self

    async def __anext__(self) -> TokenChunk:
        if self.it is None:
            self.it = (await self.owner.started()).generate(self.call).__aiter__()
        return await self.it.__anext__()

    def cancel(self) -> None:
        if self.it is not None:
            asyncio.ensure_future(self.it.aclose())


def test_streams_through_the_replicas_stream_channel_are_the_whole_answers():
    """With the stream channel (router/channels.py, replicas/channel.py) a stream's middle chunks
    come on the replica's channel and its first and last on the call: the streamed tokens are the
    whole answer's, token for token, and the channel carried some of them."""
    srv = Server(RequestLimits())
    sim = srv.replicas = srv.ingress.handle = SimReplicas()
    srv.ingress.channels = channels = StreamChannels(srv.ingress.name, sim.open_channel)
    with srv:
        for seed in range(3):
            body = {"model": MODEL, "prompt": f"hi there {seed}", "max_tokens": 60, "return_token_ids": True,
                    "seed": seed, "temperature": 1.0, "ignore_eos": True}
            whole = post(srv, "/v1/completions", body).json()["choices"][0]
            r = post(srv, "/v1/completions", {**body, "stream": True})
            events = [json.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: {")]
            ids = [t for e in events for ch in e["choices"] for t in ch.get("token_ids") or []]
            assert ids == whole["token_ids"] and len(ids) == 60
            assert "".join(ch["text"] for e in events for ch in e["choices"]) == whole["text"]
        assert all(c.channel == srv.ingress.name for c in sim.calls)
        assert channels.pieces > 0 and sim.replica.channels.flushes > 0


def test_the_engine_parameters_on_the_sim_engine_behind_its_gate():
    """The same parameters through the real replica (sim engine + gate): ``seed`` repeats the
    output, ``stop_token_ids`` ends it at the stop (finish "stop"), and the penalties,
    ``logit_bias`` and a JSON ``response_format``, which a text-less engine cannot honour, are a
    400 naming them."""
    srv = Server(RequestLimits())
    srv.replicas = srv.ingress.handle = SimReplicas()
    with srv:
        def tokens(**extra: Any) -> dict:
            body = {"model": MODEL, "prompt": "hi there", "max_tokens": 12, "return_token_ids": True, **extra}
            r = post(srv, "/v1/completions", body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        a, b, c = tokens(seed=5)["token_ids"], tokens(seed=5)["token_ids"], tokens(seed=6)["token_ids"]
        assert a == b and a != c and tokens()["token_ids"] != tokens()["token_ids"]
        # n choices with a seed: choice i is the output of seed + i, as vLLM seeds them
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 12,
                                          "return_token_ids": True, "seed": 5, "n": 2})
        assert [ch["token_ids"] for ch in r.json()["choices"]] == [a, c]
        at = next(i for i in range(2, 12) if a[i] not in a[:i])
        stopped = tokens(seed=5, stop_token_ids=[a[at]])
        assert stopped["token_ids"] == a[: at + 1] and stopped["finish_reason"] == "stop"
        for name, value in (("frequency_penalty", 0.5), ("presence_penalty", 1.0), ("repetition_penalty", 1.3),
                            ("logit_bias", {"7": 1.0})):
            r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: value})
            assert_clear_error(r, 400, f"{name} is not supported by the sim engine")
            assert r.json()["error"]["param"] == name
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = post(srv, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
        assert_clear_error(r, 400, "json_object / json_schema is not supported by the sim engine")
        assert r.json()["error"]["param"] == "response_format"
        r = post(srv, "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required"})
        assert_clear_error(r, 400, "a tool_choice that forces a call (required, or a named function) is not "
                                   "supported by the sim engine")
        assert r.json()["error"]["param"] == "tool_choice"
        r = post(srv, "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        r = post(srv, "/v1/chat/completions", {**chat, "logprobs": True})
        assert_clear_error(r, 400, "logprobs is not supported by the sim engine")
        assert r.json()["error"]["param"] == "logprobs"
        # the Responses API's own names for them: include, text
        resp = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
        r = post(srv, "/v1/responses", {**resp, "include": ["message.output_text.logprobs"]})
        assert_clear_error(r, 400, "include: logprobs is not supported by the sim engine")
        assert r.json()["error"]["param"] == "include"
        r = post(srv, "/v1/responses", {**resp, "text": {"format": {"type": "json_object"}}})
        assert_clear_error(r, 400, "text: response_format json_object")
        assert r.json()["error"]["param"] == "text"
        assert tokens(top_p=0.5, temperature=0.0, top_k=3, min_p=0.2)["finish_reason"] == "length"


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server):
    """As vLLM's and OpenAI's chat: max_tokens defaults to max_model_len - prompt (4,096 here);
    a completion's default stays OpenAI's 16."""
    tok = server.ingress.tokenizer
    msgs = [{"role": "user", "content": "tell me a story"}]
    n = len(tok.encode_chat(msgs))
    server.replicas.script = [tok.encode(" the")[0], tok.eos_token_id]
    try:
        body = {"model": MODEL, "messages": msgs, "stop_token_ids": [tok.eos_token_id]}
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
        assert server.replicas.calls[-1].max_tokens == 4096 - n
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [tok.eos_token_id]})
        assert r.status_code == 200 and server.replicas.calls[-1].max_tokens == 16
    finally:
        server.replicas.script = []


def test_chat_content_parts_other_than_text_and_malformed_tool_calls_in_history_are_refused(server):
    base = {"model": MODEL, "max_tokens": 2}
    image = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    assert_clear_error(post(server, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": image}]}),
                       400, "'image_url' are not supported")
    calls = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]
    assert_clear_error(post(server, "/v1/chat/completions", {**base, "messages": calls}), 400,
                       "messages.1.tool_calls.0.function: Field required")
    by_user = [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert_clear_error(post(server, "/v1/chat/completions", {**base, "messages": by_user}), 400,
                       "only an assistant message has tool_calls")
    ok = [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
          {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None}]
    assert post(server, "/v1/chat/completions", {**base, "messages": ok}).status_code == 200


def test_a_conversation_with_tool_calls_reaches_the_chat_template_whole(server):
    """An agent's history (the assistant's calls, the tools' answers) and the tools are what the
    template renders: the call's prompt is the template's, with each call's JSON in it."""
    tok = server.ingress.tokenizer
    args = '{"city": "Paris"}'
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": messages,
                                              "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    want = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]},
            {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    ids = server.replicas.calls[-1].prompt_token_ids
    assert ids == tok.encode_chat(want, TOOLS)
    prompt = tok.decode(ids)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt and "sunny, 21 C" in prompt
    assert prompt.index(json.dumps(TOOLS[1])) < prompt.index("weather in Paris?")  # tools first: a shared prefix


def test_a_forced_tool_call_is_answered_as_tool_calls_whole_and_streamed(server):
    """tool_choice required: the output is constrained to a list of calls (vLLM's schema) and
    answered as OpenAI's tool_calls, finish "tool_calls"; cut short, it is answered as the text
    it is, with its own finish reason, never as a made-up call. A named function streams its
    arguments as they come (covered by the parameter matrix)."""
    tok = server.ingress.tokenizer
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    ids = tok.encode(out)
    server.replicas.script = ids + [tok.eos_token_id]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required", "max_tokens": 200, "stop_token_ids": [tok.eos_token_id]}
    try:
        for stream in (False, True):
            r = post(server, "/v1/chat/completions", {**body, "stream": stream})
            assert r.status_code == 200, r.text
            calls, content, reason = _tool_calls(r, stream)
            assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                                      {"name": "now", "arguments": "{}"}]
            assert len({c["id"] for c in calls}) == 2 and (content, reason) == (None, "tool_calls")
        schema = server.replicas.calls[-1].structured_output["json"]
        assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
        assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
        assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
        assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
        post(server, "/v1/chat/completions", {**body, "parallel_tool_calls": False})
        assert server.replicas.calls[-1].structured_output["json"]["maxItems"] == 1
        for stream in (False, True):  # cut short by max_tokens: the text as it is
            r = post(server, "/v1/chat/completions", {**body, "max_tokens": 5, "stream": stream})
            calls, content, reason = _tool_calls(r, stream)
            assert (calls, content, reason) == ([], tok.decode(ids[:5]), "length")
    finally:
        server.replicas.script = []


def test_auto_tool_choice_answers_the_calls_the_parser_finds_or_the_text(server, monkeypatch):
    """With a tool-call parser (llama3_json), tool_choice auto leaves the output free and answers
    Llama 3's JSON calls as tool_calls (several separated by ";", "arguments" for "parameters"),
    finish "tool_calls"; anything else, or calls cut short, is the text it is, and a text answer
    streams as content from its first event."""
    tok = server.ingress.tokenizer
    monkeypatch.setattr(server.ingress.args, "tool_call_parser", "llama3_json")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 300,
            "stop_token_ids": [tok.eos_token_id]}
    calls = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "arguments": {}}'
    want = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "now", "arguments": "{}"}]
    try:
        for text, tool_calls, reason in ((calls, want, "tool_calls"), (WORDS, [], "stop"),
                                         (' {"name": "now"} and more', [], "stop"), (" {not json", [], "stop")):
            server.replicas.script = tok.encode(text) + [tok.eos_token_id]
            for stream in (False, True):
                r = post(server, "/v1/chat/completions", {**body, "stream": stream})
                assert r.status_code == 200, r.text
                assert server.replicas.calls[-1].structured_output is None  # the model chooses freely
                got, content, why = _tool_calls(r, stream)
                assert ([c["function"] for c in got], content, why) == (
                    tool_calls, None if tool_calls else text, reason), (text, stream)
        server.replicas.script = tok.encode(WORDS)  # text streams as it comes, not held to the end
        r = post(server, "/v1/chat/completions", {**body, "stream": True, "max_tokens": len(tok.encode(WORDS))})
        deltas = [ch["delta"] for ln in r.text.split("\n") if ln.startswith("data: {")
                  for ch in json.loads(ln[6:])["choices"]]
        assert deltas[0] == {"role": "assistant", "content": tok.decode(tok.encode(WORDS)[:1])}
        server.replicas.script = tok.encode(calls)  # calls cut short by max_tokens: the text, "length"
        got, content, why = _tool_calls(post(server, "/v1/chat/completions", {**body, "max_tokens": 6}), False)
        assert (got, content, why) == ([], tok.decode(tok.encode(calls)[:6]), "length")
    finally:
        server.replicas.script = []


def test_auto_tool_choice_with_the_hermes_parser(server, monkeypatch):
    """tool_call_parser hermes: the text before the first <tool_call> is the content, the blocks
    are the calls (finish "tool_calls"), whole and streamed; an answer without whole calls is text."""
    tok = server.ingress.tokenizer
    monkeypatch.setattr(server.ingress.args, "tool_call_parser", "hermes")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 300,
            "stop_token_ids": [tok.eos_token_id]}
    calls = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    try:
        for text, want in ((calls, ("Checking.\n", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
                                    "tool_calls")),
                           ("no <tool call here", ("no <tool call here", [], "stop"))):
            server.replicas.script = tok.encode(text) + [tok.eos_token_id]
            for stream in (False, True):
                got, content, why = _tool_calls(post(server, "/v1/chat/completions", {**body, "stream": stream}),
                                                stream)
                assert (content, [c["function"] for c in got], why) == want, (text, stream)
    finally:
        server.replicas.script = []


def test_tools_and_tool_choice_that_cannot_work_are_a_400_naming_the_problem(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    defs = {"$defs": {"c": {"type": "string"}}, "type": "object"}
    for extra, param, why in (
            ({"tools": []}, "tools", "tools must not be empty"),
            ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "name a function twice"),
            ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
            ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
            ({"tools": TOOLS}, "tool_choice", "tool_choice 'auto' (the default when tools are sent)"),
            ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "no tool_call_parser configured"),
            ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice",
             "other than none and a JSON response_format"),
            ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
             "names function 'f', which is not in tools (['get_weather', 'now'])"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
             "cannot both shape the answer"),
            ({"tools": [{"type": "function", "function": {"name": "a", "parameters": defs}},
                        {"type": "function", "function": {"name": "b", "parameters": {**defs, "$defs": {"c": {}}}}}],
              "tool_choice": "required"}, "tool_choice", "define $defs 'c' twice")):
        r = post(server, "/v1/chat/completions", {**chat, **extra})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] == param, r.json()


def test_an_unpaired_surrogate_in_a_key_is_a_400_naming_the_field(server):
    """A dict's keys are text too: the Responses API echoes ``metadata`` in its answer, which could
    not be encoded (the fuzzer found a 500 there), and JSON schemas name their properties. A key
    with half a surrogate pair is a 400 naming the field; a whole pair is served."""
    for path, raw, param in (
            ("/v1/responses", '{"input": "hi", "metadata": {"k\\ud800": "v"}, "max_output_tokens": 2}', "metadata"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                     '"response_format": {"type": "json_schema", "json_schema": {"name": "s", '
                                     '"schema": {"type": "object", "properties": {"\\udc00": {}}}}}}',
             "response_format")):
        r = post(server, path, raw[:1] + f'"model": "{MODEL}", ' + raw[1:])
        assert_clear_error(r, 400, "unpaired surrogate")
        assert r.json()["error"]["param"] == param, r.json()
    ok = {"model": MODEL, "input": "hi", "metadata": {"k\U0001F600": "v"}, "max_output_tokens": 2}
    r = post(server, "/v1/responses", ok)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k\U0001F600": "v"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "ok \\ud800 x"}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udfff"]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/completions", '{"prompt": "hi", "user": "a\\udc00"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     "messages.0.name"),
])
def test_text_with_an_unpaired_surrogate_is_a_400_naming_the_field(server, path, body, param):
    """JSON may escape half a UTF-16 surrogate pair ("\\ud800"), which decodes to no Unicode text:
    the tokenizer and the hashes cannot take it (it was a 500). It is a 400 naming the field; a
    whole pair (an emoji) is text and is served."""
    raw = body[:-1] + f', "model": "{MODEL}", "max_tokens": 2}}'
    r = post(server, path, raw)
    assert_clear_error(r, 400, "unpaired surrogate")
    assert r.json()["error"]["param"] == param
    emoji = raw.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    if emoji != raw and "cache_salt" not in raw:
        assert post(server, path, emoji).status_code == 200, emoji


def test_what_the_openai_client_and_vllm_bench_send_by_default_is_accepted(server):
    """``vllm bench serve``'s completions payload (vllm/benchmarks/lib/endpoint_request_func.py:
    repetition_penalty 1.0, logprobs None, stream_options) and the openai client's chat call."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "frequency_penalty", "presence_penalty", "stop",
                               "seed", "logit_bias", "echo", "user", "stream_options", "max_tokens")}
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", **nulls})  # null: the default, as OpenAI's
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    assert server.replicas.calls[-1].temperature == 1.0
    bench = {"model": MODEL, "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 3, "logprobs": None,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    r = post(server, "/v1/completions", bench)
    assert r.status_code == 200 and '"usage"' in r.text, r.text
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         n=1, user="u", stop=None, seed=3)
    assert out.usage.completion_tokens == 2
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                     stream_options={"include_usage": True})
    assert [c.usage.completion_tokens for c in done if c.usage] == [2]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_puts_each_choices_usage_so_far_on_every_chunk(server, chat, include_usage):
    """vLLM's ``stream_options.continuous_usage_stats`` (gateways count tokens as they stream):
    every chunk carries its choice's prompt tokens and completion tokens so far, rising to the
    answer's; the last chunk with the whole request's usage comes only with ``include_usage``."""
    body = {"model": MODEL, "max_tokens": 7, "n": 2, "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": include_usage}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6, 7]})
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 200, r.text
    events = [json.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: {")]
    prompt = len(server.replicas.calls[-1].prompt_token_ids)
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for e in events if not include_usage else events[:-1]:
        (ch,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        so_far[ch["index"]].append(u["completion_tokens"])
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[-1] == 7 and counts[0] >= 1, counts
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 14
    else:
        assert all(e["choices"] for e in events)


# -- refusals are counted ------------------------------------------------------------------


def test_every_refusal_is_counted_in_the_rejects_with_its_reason(server, monkeypatch):
    """Requests refused by validation (n=2, an empty prompt, an empty chat, a batch prompt, bad
    JSON, an unknown field, a refused parameter), by the limits and in the handler each add one
    to ``fairway_rejects_total`` with their reason, and one rejected request."""
    from observability.stats import FairwayStats

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
    monkeypatch.setattr(server.ingress, "stats", stats)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"model": MODEL, "prompt": "hi", "n": 200}, "unsupported_parameter"),
        ({"model": MODEL, "prompt": ""}, "bad_request"),
        ({"model": MODEL, "prompt": ["a", ""]}, "bad_request"),
        ({"model": MODEL, "prompt": ["a", "b"], "n": 40}, "bad_request"),  # over limits.max_choices
        ({"model": MODEL, "prompt": [1], "max_tokens": 0}, "bad_request"),
        (b"{not json", "invalid_json"),
        (b"\x1f\x8b\x08\x00 compressed", "invalid_json"),  # not UTF-8: FastAPI's own 400
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, "unknown_field"),
        ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "unsupported_parameter"),
        ({"model": "other", "prompt": "hi"}, "unknown_model"),
        ({"model": MODEL, "prompt": [5] * 10, "max_tokens": 10**6}, "too_long"),
        ({"model": MODEL, "prompt": "x " * 40_000}, "body_too_large"),
    ]
    chat_cases = [({**chat, "messages": []}, "bad_request"), ({**chat, "tools": TOOLS}, "unsupported_parameter"),
                  ({**chat, "tools": [{"type": "function"}]}, "bad_request"),
                  ({**chat, "messages": [{"role": "user", "content": "hi"}] * 9}, "bad_request")]
    responses_cases = [({"model": MODEL, "input": "hi", "store": True}, "unsupported_parameter"),
                       ({"model": MODEL, "input": "hi", "prompt": {"id": "p"}}, "unsupported_parameter"),
                       ({"model": MODEL, "input": []}, "bad_request"),
                       ({"model": MODEL, "input": "hi", "seed": 1}, "unknown_field")]
    for path, group in (("/v1/completions", cases), ("/v1/chat/completions", chat_cases),
                        ("/v1/responses", responses_cases)):
        for body, reason in group:
            before = stats.counter("rejects", reason=reason)
            rejected = stats.counter("requests", status="rejected")
            r = post(server, path, body)
            assert 400 <= r.status_code < 500, (body, r.text)
            assert stats.counter("rejects", reason=reason) == before + 1, (str(body)[:80], reason, stats.snapshot())
            assert stats.counter("requests", status="rejected") == rejected + 1
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 1}).status_code == 200
    assert stats.counter("requests", status="rejected") == rejected + 1  # a served request is no reject


def test_tokenize_gives_the_ids_the_engine_gets_and_detokenize_their_text(server):
    """vLLM's /tokenize and /detokenize: a prompt's ids as the completions route sends them, a
    chat's as its template renders it (with tools); detokenize gives the rendered text back,
    special tokens included; what cannot be answered is a 400 (or 404) naming it."""
    tok = server.ingress.tokenizer
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "hello there", "return_token_strs": True})
    ids = tok.encode("hello there")
    assert r.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids,
                        "token_strs": [tok.token_text(t) for t in ids]}
    post(server, "/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 1})
    assert server.replicas.calls[-1].prompt_token_ids == ids
    messages = [{"role": "user", "content": "weather?"}]
    r = post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    chat_ids = r.json()["tokens"]
    assert chat_ids == tok.encode_chat(messages, TOOLS) and r.json()["count"] == len(chat_ids)
    post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none",
                                          "max_tokens": 1})
    assert server.replicas.calls[-1].prompt_token_ids == chat_ids
    open_turn = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    full = tok.encode_chat(messages)  # without the assistant's header: a prefix of it
    no_header = tok.encode_chat(messages, template={"add_generation_prompt": False})
    assert open_turn == no_header == full[: len(open_turn)] != full
    text = post(server, "/detokenize", {"model": MODEL, "tokens": chat_ids}).json()["prompt"]
    assert text == tok.tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    for path, body, status, why in (
            ("/tokenize", {"prompt": "a", "messages": messages}, 400, "a prompt or messages (one of them)"),
            ("/tokenize", {"model": MODEL}, 400, "a prompt or messages (one of them)"),
            ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "go with messages"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "add_special_tokens"),
            ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "does not exist"),
            ("/tokenize", {"prompt": "word " * 10000}, 400, "maximum context length is 4096"),
            ("/detokenize", {"tokens": [10**6]}, 400, "out of the vocabulary"),
            ("/detokenize", {"tokens": [5] * 5000}, 400, "more than the context holds (4096)"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0")):
        assert_clear_error(post(server, path, body), status, why)


@pytest.fixture
def bos_tokenizer(server, monkeypatch):
    """The server's tokenizer with a BOS before every text it encodes with special tokens, as Llama
    3's does (fairway-tiny's adds none); restored after the test."""
    from tokenizers.processors import TemplateProcessing

    tok = server.ingress.tokenizer
    bos = tok.tok.bos_token
    monkeypatch.setattr(tok.tok.backend_tokenizer, "post_processor",
                        TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.tok.bos_token_id)]))
    return tok


def test_add_special_tokens_puts_the_tokenizers_own_around_the_prompt_as_vllm_does(server, bos_tokenizer):
    """vLLM's add_special_tokens: a completion's text prompt gets the tokenizer's BOS by default
    (false: none), token ids are sent as they are, and a chat's templated prompt (which writes its
    own BOS) gets none unless asked (then two, as vLLM's would); /tokenize says the same ids."""
    tok, bos = bos_tokenizer, bos_tokenizer.tok.bos_token_id
    plain = tok.encode("hello there")
    assert plain[0] != bos
    chat = [{"role": "user", "content": "hi"}]
    templated = tok.encode_chat(chat)
    assert templated[0] == bos != templated[1]
    for path, body, want in (
            ("/v1/completions", {"prompt": "hello there"}, [bos, *plain]),
            ("/v1/completions", {"prompt": "hello there", "add_special_tokens": False}, plain),
            ("/v1/completions", {"prompt": plain}, plain),
            ("/v1/completions", {"prompt": plain, "add_special_tokens": True}, plain),
            ("/v1/chat/completions", {"messages": chat}, templated),
            ("/v1/chat/completions", {"messages": chat, "add_special_tokens": True}, [bos, *templated])):
        for stream in (False, True):
            r = post(server, path, {"model": MODEL, "max_tokens": 2, "stream": stream, **body})
            assert r.status_code == 200, r.text
            assert server.replicas.calls[-1].prompt_token_ids == want, body
    for body, want in (({"prompt": "hello there"}, [bos, *plain]),
                       ({"prompt": "hello there", "add_special_tokens": False}, plain),
                       ({"messages": chat}, templated), ({"messages": chat, "add_special_tokens": True},
                                                         [bos, *templated])):
        assert post(server, "/tokenize", body).json()["tokens"] == want, body


def test_truncate_prompt_tokens_keeps_the_prompts_first_or_last_tokens_and_routes_on_them(server):
    """vLLM's truncate_prompt_tokens: the call carries the kept tokens (the last with
    truncation_side left, the default as in vLLM's server, the first with right; -1: the context
    less one) and the block hashes of those, so the router estimates the cache on what the engine
    will read; a text far over the context is served, tokenizing only its kept side; echo gives
    the kept prompt's text; what cannot be kept is a 400 naming the field."""
    from fairway.hashing import block_hashes

    tok = server.ingress.tokenizer
    long_text = " ".join(f"w{i}" for i in range(6000))  # about 12,000 tokens: 3x the context
    full = tok.encode(long_text)
    assert len(full) > 3 * 4096
    base = {"model": MODEL, "prompt": long_text, "max_tokens": 2}
    assert_clear_error(post(server, "/v1/completions", base), 400, "maximum context length is 4096")
    for extra, want in (({"truncate_prompt_tokens": 100, "truncation_side": "left"}, full[-100:]),
                        ({"truncate_prompt_tokens": 100, "truncation_side": "right"}, full[:100]),
                        ({"truncate_prompt_tokens": 100}, full[-100:]),  # vLLM's default side: left
                        ({"truncate_prompt_tokens": -1, "truncation_side": "left", "max_tokens": 1}, full[-4095:])):
        r = post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        call = server.replicas.calls[-1]
        assert call.prompt_token_ids == want and r.json()["usage"]["prompt_tokens"] == len(want), extra
        assert list(call.block_hashes) == block_hashes(want, server.ingress.block_size, call.cache_salt)
    ids_prompt = {**base, "prompt": full[:300], "truncate_prompt_tokens": 10, "truncation_side": "left"}
    assert post(server, "/v1/completions", ids_prompt).status_code == 200
    assert server.replicas.calls[-1].prompt_token_ids == full[290:300]
    r = post(server, "/v1/completions", {**base, "prompt": "hello there friend", "truncate_prompt_tokens": 2,
                                         "truncation_side": "left", "echo": True, "max_tokens": 1})
    kept = tok.encode("hello there friend")[-2:]
    assert r.json()["choices"][0]["text"].startswith(tok.decode(kept))
    assert server.replicas.calls[-1].prompt_token_ids == kept
    messages = [{"role": "user", "content": long_text}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                              "truncate_prompt_tokens": 50, "truncation_side": "left"})
    assert r.status_code == 200, r.text
    assert server.replicas.calls[-1].prompt_token_ids == tok.encode_chat(messages)[-50:]
    for extra, why in (({"truncate_prompt_tokens": 0}, "at least 1, or -1"),
                       ({"truncate_prompt_tokens": -2}, "greater than or equal to -1"),
                       ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens (5000) is more than this model's "
                                                          "context (4096 tokens)"),
                       ({"truncation_side": "left"}, "truncation_side goes with truncate_prompt_tokens"),
                       ({"truncate_prompt_tokens": 10, "truncation_side": "middle"}, "'left' or 'right'"),
                       ({"truncate_prompt_tokens": 4000, "max_tokens": 200}, "maximum context length is 4096")):
        r = post(server, "/v1/completions", {**base, **extra})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] in ("truncate_prompt_tokens", "truncation_side", None), r.json()


@pytest.mark.parametrize("text", [
    " ".join(f"w{i}" for i in range(9000)),  # words: pieces cut at a whitespace
    "é日本語 " * 4000 + "x" * 9000,  # multi-byte characters, then a long word where the cut falls
    "a" * 60000,  # one word: no whitespace near any cut, so tokenized whole
    ("line one\n\n  two<|eot_id|>three   four\t" * 1500),  # runs of whitespace and special tokens' text
], ids=["words", "multibyte", "one-word", "mixed"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_the_kept_side_of_a_long_text_is_tokenized_as_the_whole_text_would_be(server, text, side):
    """``Tokenizer.encode_kept`` gives exactly the first (right) or last (left) ``keep`` ids of the
    whole text's tokenization, with and without special tokens added, for any ``keep``."""
    from router.tokenizer import kept

    tok = server.ingress.tokenizer
    for special in (False, True):
        whole = tok.encode(text, special)
        for keep in (1, 37, 500, 3000, len(whole) + 5):
            assert tok.encode_kept(text, keep, side, special) == kept(whole, (keep, side)), (keep, special)


def test_sampling_constraints_are_checked_before_they_reach_the_engine(server):
    """allowed_token_ids (as a set) and bad_words go to the engine's sampler (vLLM's; the sim
    engine draws from the allowed ids and refuses bad words: test_sim_engine); ids outside the vocabulary, an
    empty list, blank words and more words than vLLM's engine takes are 400s naming the field."""
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert post(server, "/v1/completions", {**base, "allowed_token_ids": [9, 7, 9] * 1000, "bad_words": ["x y"]}).ok
    assert server.replicas.calls[-1].allowed_token_ids == (7, 9)  # a set: each id once
    assert server.replicas.calls[-1].bad_words == ("x y",)
    assert post(server, "/v1/completions", base).ok
    assert server.replicas.calls[-1].allowed_token_ids is None and server.replicas.calls[-1].bad_words == ()
    for extra, param, why in (({"allowed_token_ids": [10**6]}, "allowed_token_ids", "out of the vocabulary"),
                              ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
                              ({"bad_words": ["ok", " "]}, "bad_words", "each with a character other than whitespace"),
                              ({"bad_words": ["w"] * 65}, "bad_words", "at most 64 bad words")):
        r = post(server, "/v1/completions", {**base, **extra})
        assert_clear_error(r, 400, why)
        assert r.json()["error"]["param"] == param


def test_auth_refusals_are_counted(monkeypatch):
    from observability.stats import FairwayStats

    monkeypatch.setenv("FAIRWAY_TEST_KEYS", "k1=alice")
    with Server(RequestLimits(), auth=AuthArgs(keys_env="FAIRWAY_TEST_KEYS")) as srv:
        stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
        srv.ingress.stats = stats
        body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
        assert post(srv, "/v1/completions", body).status_code == 401
        assert post(srv, "/v1/completions", body, headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = {"Authorization": "Bearer k1"}
        assert post(srv, "/v1/completions", body, headers={**ok, "X-Fairway-Prefix-Group": "g"}).status_code == 403
        assert post(srv, "/v1/completions", body, headers=ok).status_code == 200
        assert post(srv, "/tokenize", {"prompt": "hi"}).status_code == 401  # the tokenizer routes need a key too
        assert post(srv, "/tokenize", {"prompt": "hi"}, headers=ok).status_code == 200
    assert stats.counter("rejects", reason="unauthorized") == 3 and stats.counter("rejects", reason="forbidden") == 1


def test_a_requests_class_comes_from_its_body_header_or_tenant_and_is_measured(monkeypatch):
    """With classes configured, each request carries its class to the replicas and gets it back in
    the ``fairway`` object; its TTFT is counted by class against the class's objective."""
    from observability.stats import FairwayStats

    monkeypatch.setenv("FAIRWAY_TEST_KEYS", "k1=alice,k2=evals")
    auth = AuthArgs(keys_env="FAIRWAY_TEST_KEYS", tenants={"evals": {"default_class": "batch"}})
    with Server(RequestLimits(), auth=auth, classes="interactive:tier=0:objective=60,batch:tier=1:objective=30,"
                                                   "bulk:tier=1:objective=1e-9") as srv:
        stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
        srv.ingress.stats = stats
        alice, evals = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
        cases = [({}, alice, "bulk"),  # the cluster's default: the last class
                 ({"priority": "interactive"}, evals, "interactive"),  # the body, over the tenant's default
                 ({"priority": 0}, alice, "interactive"),  # an integer tier, as vLLM's priority
                 ({"priority": 1}, alice, "batch"),  # the first class of tier 1
                 ({}, {**alice, "X-Fairway-Class": "batch"}, "batch"),  # the header
                 ({}, evals, "batch")]  # the tenant's default
        for extra, headers, want in cases:
            r = post(srv, "/v1/completions", {**body, **extra}, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["fairway"]["class"] == want and srv.replicas.calls[-1].priority_class == want, extra
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 0}
        r = post(srv, "/v1/chat/completions", chat, headers=alice)
        assert r.status_code == 200 and r.json()["fairway"]["class"] == "interactive"
        n = len(srv.replicas.calls)
        for extra, headers, needle in [
            ({"priority": 7}, alice, "priority: no request class has priority (tier) 7; valid: 0, 1, or a class name"),
            ({"priority": "gold"}, alice, "priority: unknown class 'gold'; valid: interactive, batch, bulk"),
            ({"priority": True}, alice, "priority"),
            ({}, {**alice, "X-Fairway-Class": "gold"}, "X-Fairway-Class: unknown class 'gold'")]:
            r = post(srv, "/v1/completions", {**body, **extra}, headers=headers)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert len(srv.replicas.calls) == n  # nothing refused reached a replica
    assert stats.counter("class_objective", **{"class": "interactive", "objective": "met"}) == 3
    assert stats.counter("class_objective", **{"class": "bulk", "objective": "missed"}) == 1
    assert stats.counter("class_objective", **{"class": "batch", "objective": "met"}) == 3


def test_browsers_of_the_allowed_origins_may_call_the_api_and_preflights_need_no_key(monkeypatch):
    """With ``cors.allowed_origins``, a preflight from an allowed origin is answered 200 without a
    key, naming the origin; a call from it carries the origin's header, a 401 too; another origin's
    preflight is refused and its calls carry no such header. Without origins (the default), a
    preflight is a 405 and no answer names an origin, as vLLM's default."""
    monkeypatch.setenv("FAIRWAY_TEST_KEYS", "k1=alice")
    auth = AuthArgs(keys_env="FAIRWAY_TEST_KEYS")
    app_origin, other = "https://chat.example.com", "https://evil.example.net"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
    with Server(RequestLimits(), auth=auth, cors=CorsArgs(allowed_origins=(app_origin,))) as srv:
        r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": app_origin, **preflight}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app_origin, r.text
        assert "POST" in r.headers["access-control-allow-methods"]
        r = post(srv, "/v1/completions", body, headers={"Origin": app_origin, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app_origin
        r = post(srv, "/v1/completions", body, headers={"Origin": app_origin})  # no key: 401, readable
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == app_origin
        r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": other, **preflight}, timeout=10)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = post(srv, "/v1/completions", body, headers={"Origin": other, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with Server(RequestLimits(), auth=auth) as srv:
        r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": app_origin, **preflight}, timeout=10)
        assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers, r.text
        r = post(srv, "/v1/completions", body, headers={"Origin": app_origin, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_tenant_may_use_only_its_own_classes(monkeypatch):
    """A tenant limited to some classes (``auth.tenants.<name>.classes``) gets 403 naming them for
    a request that names another class, by body, tier or header; its own classes and its default
    pass; a tenant without the list may use every class."""
    monkeypatch.setenv("FAIRWAY_TEST_KEYS", "k1=alice,k2=evals")
    auth = AuthArgs(keys_env="FAIRWAY_TEST_KEYS",
                    tenants={"evals": {"default_class": "batch", "classes": ["batch", "bulk"]}})
    with Server(RequestLimits(), auth=auth, classes="interactive:tier=0,batch:tier=1,bulk:tier=1") as srv:
        alice, evals = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
        allowed = [({}, evals, "batch"), ({"priority": "bulk"}, evals, "bulk"), ({"priority": 1}, evals, "batch"),
                   ({"priority": "interactive"}, alice, "interactive")]
        for extra, headers, want in allowed:
            r = post(srv, "/v1/completions", {**body, **extra}, headers=headers)
            assert r.status_code == 200 and r.json()["fairway"]["class"] == want, (extra, r.text)
        n = len(srv.replicas.calls)
        refused = [({"priority": "interactive"}, evals, "priority"), ({"priority": 0}, evals, "priority"),
                   ({}, {**evals, "X-Fairway-Class": "interactive"}, "X-Fairway-Class")]
        for extra, headers, where in refused:
            r = post(srv, "/v1/completions", {**body, **extra}, headers=headers)
            assert_clear_error(r, 403, f"{where}: tenant 'evals' may not use request class 'interactive'; "
                                       "its classes: batch, bulk")
            assert r.json()["error"]["type"] == "permission_error"
            assert r.json()["error"]["param"] == ("priority" if extra else None)
        assert len(srv.replicas.calls) == n  # nothing refused reached a replica


def test_without_classes_only_priority_zero_is_accepted(server):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
    r = post(server, "/v1/completions", {**body, "priority": 0})
    assert r.status_code == 200 and "class" not in r.json()["fairway"]
    r = post(server, "/v1/completions", {**body, "priority": 1})
    assert r.status_code == 400 and "no request classes configured" in r.json()["error"]["message"]


# -- hostile input -----------------------------------------------------------------------------

def texts(max_size: int) -> st.SearchStrategy[str]:
    """Strings, half of them with unpaired UTF-16 surrogates mixed in (which ``st.text`` never
    draws, and JSON can carry as "\\ud800" escapes)."""
    odd = st.lists(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=max_size).map("".join)
    return st.text(max_size=max_size) | odd


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts(40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(texts(12), inner, max_size=6),
    max_leaves=30,
)
fields = {
    "model": st.sampled_from([MODEL, "other", ""]) | json_values,
    "prompt": texts(200) | st.lists(st.integers(-5, 5000), max_size=50) | json_values,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
         "content": texts(80) | json_values}), max_size=10) | json_values,
    "max_tokens": st.integers(-3, 5000) | json_values,
    "max_completion_tokens": st.integers(-3, 50) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()},
                                            optional={"continuous_usage_stats": st.booleans()}) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans() | json_values,
    "cache_salt": texts(20) | json_values,
    "stop": texts(5) | st.lists(texts(5), max_size=20) | json_values,
    "stop_token_ids": st.lists(st.integers(-3, 10**6), max_size=20) | json_values,
    "seed": st.integers(-(2**70), 2**70) | json_values,
    "logit_bias": st.dictionaries(st.integers(-3, 10**5).map(str), st.floats(-200, 200), max_size=4) | json_values,
    "echo": st.booleans() | json_values,
    "logprobs": st.none() | st.integers(0, 5) | json_values,
    "top_p": st.floats(-1, 2, allow_nan=False) | json_values,
    "tools": st.none() | json_values,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_values,
}
bodies = st.fixed_dictionaries({}, optional=fields)


def check_answer(r: requests.Response) -> None:
    """Every answer is a 2xx with a body, or a 4xx with an OpenAI error object that says why."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        frames = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert frames[-1] == "data: [DONE]", r.text[-200:]
    else:
        assert r.json()["choices"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_never_get_a_5xx_and_always_a_clear_answer(server, body, path):
    check_answer(post(server, path, body, timeout=10))


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(read=st.integers(0, 3000), max_tokens=st.integers(1, 400), stream=st.booleans())
def test_clients_that_stop_reading_anywhere_leave_no_call_open(server, read, max_tokens, stream):
    """A client reads the first ``read`` bytes of a (streamed or whole) answer and closes: every
    replica call ends, finished or cancelled, and the server answers the next request."""
    body = json.dumps({"model": MODEL, "prompt": [5] * 20, "max_tokens": max_tokens, "stream": stream}).encode()
    calls = len(server.replicas.calls)
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    s.settimeout(0.3)  # a whole answer shorter than ``read`` leaves a kept-alive connection idle
    got = b""
    try:
        while len(got) < read and (chunk := s.recv(min(4096, read - len(got)))):
            got += chunk
    except TimeoutError:
        pass
    s.close()
    deadline = time.monotonic() + 10
    while (len(server.replicas.calls) == calls or server.replicas.open) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.replicas.calls) == calls + 1 and not server.replicas.open
    check_answer(post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode),
       ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_fuzzed_raw_bytes_and_content_types_get_4xx_not_5xx(server, raw, ctype):
    r = requests.post(server.url + "/v1/completions", data=raw, headers={"Content-Type": ctype} if ctype else {},
                      timeout=10)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
    assert r.json()["error"]["message"], r.text[:200]  # OpenAI's error shape, whatever failed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers=st.dictionaries(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20).filter(
        lambda k: k not in ("content-length", "transfer-encoding", "host", "content-type", "connection")),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip), max_size=8))
def test_fuzzed_headers_do_not_change_the_answer(server, headers):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}, headers=headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404_naming_it(server):
    """``GET /v1/models/{id}``, what the openai client's ``models.retrieve`` sends."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    m = client.models.retrieve(MODEL)
    listed = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "fairway")
    assert requests.get(server.url + f"/v1/models/{MODEL}", timeout=10).json() == listed[0]
    with pytest.raises(NotFoundError, match="`gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    r = requests.get(server.url + "/v1/models/org/some-model", timeout=10)  # ids with a slash
    assert_clear_error(r, 404, "`org/some-model` does not exist")


def test_bytes_that_are_not_json_and_unknown_paths_get_openai_shaped_errors(server):
    r = requests.post(server.url + "/v1/completions", data=b"\x00\xff\xfe garbage", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert_clear_error(r, 400, "not UTF-8 text")
    gz = gzip.compress(json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode())
    r = requests.post(server.url + "/v1/completions", data=gz, timeout=10,
                      headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert_clear_error(r, 400, "Content-Encoding 'gzip', which this server does not decode")
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):  # the latter is what curl -d sends
        r = requests.post(server.url + "/v1/completions", data=body, headers={"Content-Type": ctype}, timeout=10)
        assert_clear_error(r, 400, "Content-Type: application/json")
    r = requests.post(server.url + "/v1/completions", data="[1, 2]", timeout=10)  # no content type: parsed as JSON
    assert r.status_code == 400 and "Content-Type" not in r.json()["error"]["message"], r.text
    r = requests.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=10)
    assert_clear_error(r, 404, "invalid URL (POST /v1/embeddings): this server serves POST /v1/completions")
    r = requests.get(server.url + "/v1/completions", timeout=10)
    assert_clear_error(r, 405, "method GET is not allowed on /v1/completions (allowed: POST)")
    assert r.json()["error"]["type"] == "invalid_request_error"  # the client's mistake, not the server's


def test_an_oversized_header_block_is_refused_with_431(server):
    r = requests.get(server.url + "/health", headers={"x-junk": "a" * 200_000}, timeout=10)
    assert_clear_error(r, 431, "the limit is 32768 bytes")


# -- the OpenAPI schema, fuzzed (schemathesis) -------------------------------------------------


@pytest.mark.slow
def test_the_openapi_schema_fuzzed_never_gets_a_5xx_and_documents_every_answer(server):
    """Every operation of the ingress's own OpenAPI schema, with inputs schemathesis generates
    from it (valid and invalid; bodies sent once as generated and once naming the served model):
    no 5xx, an answer within 10 s each, and every answer as the schema documents it (its status
    listed, with OpenAI's error body and its headers), and no invalid input accepted. Valid input
    may still get a 400 the schema cannot express (a refused parameter's other values, a prompt
    over the context), so acceptance is not checked."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance, negative_data_rejection]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    before = len(server.replicas.calls)
    # A body without max_tokens gets the rest of the 4,096-token context: at 1 ms a token, 40
    # such examples per route took a minute. The answers are the same without the wait.
    server.replicas.token_delay_s = 0.0
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/health", "/v1/models",
                                       "/v1/models/{model}"}
    schema_json = requests.get(server.url + "/openapi.json", timeout=10).json()
    answers = schema_json["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in answers and {"400", "404", "429", "503"} <= set(answers)  # 400, as OpenAI's API answers
    assert "Retry-After" in answers["429"]["headers"]
    op_ids = [o["operationId"] for route in schema_json["paths"].values() for o in route.values()]
    assert len(op_ids) == len(set(op_ids)), op_ids  # code generators name a method after each
    try:
        for op in ops:
            @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                      derandomize=True)  # the same examples every run: a CI failure reproduces
            @given(case=op.as_strategy())
            def fuzz(case):
                case.call_and_validate(checks=checks, timeout=10)
                if isinstance(case.body, dict):  # again with the served model, to get past the 404
                    case.body["model"] = MODEL
                    case.call_and_validate(checks=checks, timeout=10)

            fuzz()
    finally:
        server.replicas.token_delay_s = 0.001
    assert len(server.replicas.calls) > before  # some generated bodies were valid and served


def test_the_exported_ttft_starts_when_the_headers_arrive_not_after_tokenization(server, monkeypatch):
    """The router's TTFT is what the client waits for: it counts the tokenization (made slow
    here) that comes before the call is sent; the ingress's own share and the end-to-end time are
    exported beside it."""
    from observability.stats import FairwayStats

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
    monkeypatch.setattr(server.ingress, "stats", stats)
    tok = server.ingress.tokenizer
    real, spans = tok.encode, []

    def slow(text: str, *a: Any) -> list[int]:
        t0 = time.time()
        time.sleep(0.2)  # a long prompt's tokenization
        spans.append(time.time() - t0)
        return real(text, *a)

    monkeypatch.setattr(tok, "encode", slow)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    (span,) = spans
    ttft = r.json()["fairway"]["ttft_s"]
    call = server.replicas.calls[-1]
    assert 0 < call.received_s <= call.arrival_s - span  # sent only after the tokenizer returned
    assert ttft >= span
    snap = stats.snapshot()
    (ingress,) = snap["histograms"]["ingress"]
    assert ingress["count"] == 1 and ingress["sum"] >= span
    (e2e,) = snap["histograms"]["e2e"]
    assert e2e["count"] == 1 and e2e["sum"] >= ttft


@pytest.mark.parametrize("stream", [False, True])
def test_the_routers_expected_first_token_time_is_compared_with_the_replicas(server, monkeypatch, stream):
    """The time the request router expected to the first token (set on the call as it routes it;
    the scripted handle stands in for it) against the first token's time at the replica: their
    ratio, by the routing reason. A call without an expectation (a router that predicts none)
    adds nothing."""
    from observability.stats import FairwayStats

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
    monkeypatch.setattr(server.ingress, "stats", stats)
    monkeypatch.setattr(server.replicas, "routed", (0.05, "affinity"))
    monkeypatch.setattr(server.replicas, "replica_ttft_s", 0.2)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": stream}
    assert post(server, "/v1/completions", body).status_code == 200
    (h,) = stats.snapshot()["histograms"]["ttft_model"]
    assert h["labels"] == {"reason": "affinity"} and h["count"] == 1 and h["sum"] == pytest.approx(4.0)
    monkeypatch.setattr(server.replicas, "routed", None)
    assert post(server, "/v1/completions", body).status_code == 200
    (h,) = stats.snapshot()["histograms"]["ttft_model"]
    assert h["count"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_a_full_gate_refused_is_tried_once_more_elsewhere_then_held(server, monkeypatch, stream):
    """A replica's gate refuses the request (429, queue full) before its engine sees it: the
    ingress sends it once more with that replica to avoid, and the client gets the answer. Refused
    again, it is held at the router and sent (with ``ack``) once a gate takes it; no engine ever
    gets it twice (each refusal was before an engine)."""
    from observability.stats import FairwayStats

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
    monkeypatch.setattr(server.ingress, "stats", stats)
    monkeypatch.setattr(server.ingress.holder, "stats", stats)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream}
    before = len(server.replicas.calls)
    server.replicas.refuse = 1
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    first, retry = server.replicas.calls[before:]
    assert first.avoid == () and retry.avoid == ("r0",) and retry.request_id == first.request_id
    assert stats.counter("retries", reason="queue_full") == 1
    server.replicas.refuse = 4  # the pick, the retry, and the first two held sends
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["fairway"]["held_s"] > 0
    sends = server.replicas.calls[before + 2:]
    assert [c.ack for c in sends] == [False, False, True, True, True]
    assert len({c.request_id for c in sends}) == 1
    assert stats.counter("retries", reason="queue_full") == 2
    (held,) = stats.snapshot()["histograms"]["hold"]
    assert held["labels"]["status"] == "sent" and held["count"] == 1 and held["sum"] > 0
    assert not server.replicas.open and len(server.ingress.holder) == 0


def test_without_holding_a_request_refused_twice_gets_429_with_retry_after():
    """``hold.max_wait_s: 0`` (no class): refused by its pick and by the retry, the client gets
    the gates' 429 with Retry-After at once; never a third send."""
    with Server(RequestLimits(), hold=HoldArgs(max_wait_s=0)) as srv:
        srv.replicas.refuse = 2
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
        assert_clear_error(r, 429, "wait bound of 0 s")
        assert r.headers["Retry-After"] == "2"
        assert len(srv.replicas.calls) == 2
        assert not srv.replicas.open


def test_a_held_request_past_its_class_bound_gets_429_and_is_counted_by_class(monkeypatch):
    """A class's ``max_wait_s`` is its bound at the router: held until it passes, then 429 with
    Retry-After, in the rejects by class; a class whose bound is under the gates' estimate is
    refused at once."""
    from observability.stats import FairwayStats

    with Server(RequestLimits(), classes="int:tier=0:objective=1,batch:tier=1:objective=30:max_wait=2.5",
                hold=HoldArgs(poll_s=0.1)) as srv:
        stats = FairwayStats(level="router", component="ingress-test", policy="fairway")
        monkeypatch.setattr(srv.ingress, "stats", stats)
        monkeypatch.setattr(srv.ingress.holder, "stats", stats)
        srv.replicas.refuse = 10**6
        t0 = time.monotonic()
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "priority": "batch"})
        assert_clear_error(r, 429, "stayed full within this request's wait bound of 2.5 s")
        assert 2.0 <= time.monotonic() - t0 < 8 and r.headers["Retry-After"] == "2"
        assert len(srv.replicas.calls) >= 3 and all(c.ack for c in srv.replicas.calls[2:])
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "priority": "int"})
        assert_clear_error(r, 429, "past this request's wait bound of 1 s")
        assert stats.counter("class_rejects", **{"class": "batch", "reason": "hold_timeout"}) == 1
        assert stats.counter("class_rejects", **{"class": "int", "reason": "hold_bound"}) == 1
        assert stats.counter("rejects", reason="hold_timeout") == 1
        assert len(srv.ingress.holder) == 0


def test_the_loop_watch_sees_a_blocked_event_loop():
    """``watch_loop`` records how late the loop runs its timer: a handler that blocks the loop for
    0.3 s shows as a lag of at least 0.2 s (every request waited that long before its stamp)."""
    from observability.stats import FairwayStats
    from router.ingress import watch_loop

    stats = FairwayStats(level="router", component="ingress-test", policy="fairway")

    async def run() -> None:
        watch = asyncio.get_running_loop().create_task(watch_loop(stats, period_s=0.05))
        await asyncio.sleep(0.12)  # two quiet periods
        time.sleep(0.3)  # a handler holding the loop
        await asyncio.sleep(0.12)
        watch.cancel()

    asyncio.run(run())
    (lag,) = stats.snapshot()["histograms"]["loop_lag"]
    assert lag["count"] >= 3
    worst = next(b for b, c in zip(lag["bounds"], lag["buckets"], strict=True) if c == lag["count"])
    assert worst >= 0.2 and lag["sum"] >= 0.2
