"""End-to-end on real vLLM (CPU): ``serve run deploy/cluster-vllm-cpu.yaml``, real HTTP, no mocks.

Runs only where vLLM imports and the tiny Llama exists (``scripts/vllm_cpu_setup.sh`` makes both);
``scripts/test_vllm.sh`` sets up and runs this with ``.venv-vllm/bin/python``. One cluster start
for the module (one replica: vLLM starts in ~30-60 s on 2 cores).

The prefix-cache hit here is vLLM's own ``num_cached_tokens``, passed through the gate and the
ingress as ``usage.prompt_tokens_details.cached_tokens``: whole vLLM CPU blocks (128 tokens).

The cluster has two request classes (``interactive``, tier 0; ``batch``, tier 1, the default), so
strict tiers are on (the default with two tiers) and every test here runs through vLLM's priority
scheduling and the strict-tier scheduler class in vLLM's engine-core process.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.launch import DEFAULT_PORT, REPO, post_json, running_cluster, serve_log_path
from tests.factories import prompt_ids

TINY_MODEL = REPO / "deploy" / "models" / "fairway-tiny-llama"
CONFIG = "deploy/cluster-vllm-cpu.yaml"
MODEL = "fairway-tiny"
MAX_MODEL_LEN = 4096  # overrides the YAML's 16384: the same boundary, a shorter too-long prompt
VLLM_CPU_BLOCK = 128
PREFIX = 2100  # shared tokens: 16 whole vLLM blocks (2,048 tokens) can hit
# not the sim clusters' port, so a concurrent sim e2e run on this machine cannot answer for this one
PORT = DEFAULT_PORT + 17
# API keys on: two tenants, so the cache isolation between them is checked on vLLM's own cache
KEYS_ENV = {"FAIRWAY_TEST_KEYS": "k-alice=alice,k-bob=bob"}
CLASSES = [{"name": "interactive", "tier": 0, "objective_s": 5.0}, {"name": "batch", "tier": 1, "objective_s": 60.0}]
ALICE, BOB = "k-alice", "k-bob"


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed here (run scripts/test_vllm.sh, or .venv-vllm/bin/python -m pytest)"
    if not (TINY_MODEL / "config.json").exists():
        return f"tiny model missing: {TINY_MODEL} (run scripts/vllm_cpu_setup.sh)"
    if not Path(sys.executable).with_name("serve").exists() and shutil.which("serve") is None:
        return "the `serve` CLI is not installed next to this python"
    return None


pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def _wait_port_free(timeout_s: float = 600.0) -> None:
    """Another cluster on the port (a concurrent test run on this machine) would answer our
    requests as if it were this one; wait for it to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", PORT)) != 0:
                return
        if time.monotonic() > deadline:
            pytest.fail(f"port {PORT} stayed busy for {timeout_s:.0f} s (another cluster running?)")
        time.sleep(2.0)


@pytest.fixture(scope="module")
def url():
    _wait_port_free()
    with running_cluster(CONFIG, timeout_s=420, port=PORT, api_key=ALICE, env=KEYS_ENV, max_model_len=MAX_MODEL_LEN,
                         auth={"keys_env": "FAIRWAY_TEST_KEYS"}, classes=CLASSES) as u:
        with urllib.request.urlopen(_get(f"{u}/v1/models"), timeout=10) as r:
            served = json.loads(r.read())["data"][0]
        assert served["max_model_len"] == MAX_MODEL_LEN, f"another cluster answers on port {PORT}: {served}"
        yield u


def _get(url: str, key: str = ALICE) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})


def complete(url: str, prompt, max_tokens: int = 4, key: str = ALICE, **extra) -> tuple[int, dict, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return post_json(f"{url}/v1/completions", body, timeout=180, headers={"authorization": f"Bearer {key}"})


def test_served_by_vllm(url):
    with urllib.request.urlopen(_get(f"{url}/v1/models"), timeout=10) as r:
        body = json.loads(r.read())
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    status, body, _ = complete(url, "The Fair lane bounds waiting.", max_tokens=6)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6  # ignore_eos: exactly max_tokens
    assert body["choices"][0]["finish_reason"] == "length"
    assert isinstance(body["choices"][0]["text"], str)


def test_request_classes_reach_vllms_strict_tier_scheduler(url):
    """Each class is served and labelled; an unknown one is a 400 naming the valid ones; the
    engine-core process runs the strict-tier scheduler (vLLM names a custom scheduler class in
    its log when it builds it)."""
    for priority, klass in (("interactive", "interactive"), ("batch", "batch"), (0, "interactive"), (None, "batch")):
        extra = {} if priority is None else {"priority": priority}
        status, body, _ = complete(url, prompt_ids(7, 40), max_tokens=3, **extra)
        assert status == 200 and body["fairway"]["class"] == klass, (priority, body)
    status, body, _ = complete(url, prompt_ids(7, 40), max_tokens=3, priority="gold")
    assert status == 400 and "valid: interactive, batch" in body["error"]["message"]
    assert "StrictTierScheduler" in serve_log_path().read_text(errors="replace")


def test_real_prefix_cache_hit_through_the_router(url):
    shared = prompt_ids(1, PREFIX)
    status, first, _ = complete(url, shared + prompt_ids(101, 24))
    assert status == 200, first
    assert first["usage"]["prompt_tokens"] == PREFIX + 24
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, second, _ = complete(url, shared + prompt_ids(102, 40))
    assert status == 200, second
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % VLLM_CPU_BLOCK == 0
    assert cached == PREFIX // VLLM_CPU_BLOCK * VLLM_CPU_BLOCK  # every whole shared block hit
    assert second["fairway"]["replica"] == first["fairway"]["replica"]


def test_streaming(url):
    body = json.dumps({"model": MODEL, "prompt": prompt_ids(5, 300), "max_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json",
                                                                             "authorization": f"Bearer {ALICE}"})
    with urllib.request.urlopen(req, timeout=180) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln.decode().strip() for ln in r if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    tokens = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_min_tokens_keeps_the_stop_tokens_away_until_then(url):
    """vLLM's min_tokens through the cluster: the greedy answer's own second token as a stop
    token ends it there; with min_tokens past it, the answer runs on to at least min_tokens."""
    base = {"model": MODEL, "prompt": prompt_ids(9, 40), "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}
    headers = {"authorization": f"Bearer {ALICE}"}
    status, out, _ = post_json(f"{url}/v1/completions", base, timeout=180, headers=headers)
    assert status == 200, out
    free = out["choices"][0]["token_ids"]
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stop = {**base, "stop_token_ids": [free[at]]}
    status, out, _ = post_json(f"{url}/v1/completions", stop, timeout=180, headers=headers)
    assert out["choices"][0]["token_ids"] == free[: at + 1] and out["choices"][0]["finish_reason"] == "stop", out
    bar = min(at + 3, 12)
    status, out, _ = post_json(f"{url}/v1/completions", {**stop, "min_tokens": bar}, timeout=180, headers=headers)
    assert status == 200, out
    held = out["choices"][0]["token_ids"]
    assert len(held) >= bar and free[at] not in held[:bar], (held, free[at])


def test_response_format_json_schema_constrains_the_answer(url):
    """OpenAI's structured output through the cluster: vLLM's grammar keeps even the tiny model's
    random weights to the schema's values, and the answer ends there."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
            "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "yn", "schema": schema}}}
    status, out, _ = post_json(f"{url}/v1/chat/completions", body, timeout=180,
                               headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    assert json.loads(out["choices"][0]["message"]["content"]) in ("yes", "no")
    assert out["choices"][0]["finish_reason"] == "stop"


UNIT = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "temperature", "parameters": UNIT}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}]


def test_a_forced_tool_call_is_a_call_of_the_tools_schema(url):
    """tool_choice required and a named function through the cluster: vLLM's grammar holds even
    the tiny model's random weights to the tools' JSON, answered as OpenAI's tool_calls whose
    arguments follow the schema."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the temperature?"}],
            "max_tokens": 120, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0}
    status, out, _ = post_json(f"{url}/v1/chat/completions", body, timeout=180,
                               headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert (call["function"]["name"], args) in (("clock", {}), ("temperature", {"unit": "c"}),
                                                ("temperature", {"unit": "f"}))
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "temperature"}}}
    status, out, _ = post_json(f"{url}/v1/chat/completions", named, timeout=180,
                               headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "temperature" and json.loads(call["function"]["arguments"]) in (
        {"unit": "c"}, {"unit": "f"})
    # tool_choice auto (the default with tools; the config's tool_call_parser is llama3_json): the
    # output is free, and the answer is calls or text, never both
    auto = {k: v for k, v in body.items() if k != "tool_choice"} | {"max_tokens": 8}
    status, out, _ = post_json(f"{url}/v1/chat/completions", auto, timeout=180,
                               headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    message = out["choices"][0]["message"]
    assert (message["content"] is None) == bool(message.get("tool_calls")), message


def test_a_forced_call_through_the_responses_api(url):
    """The Responses API's flat tools and tool_choice on vLLM: the grammar holds the answer to a
    call of the named function, answered as a function_call item."""
    body = {"model": MODEL, "input": "What is the temperature?", "max_output_tokens": 60, "temperature": 0,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": {"type": "function", "name": "temperature"}}
    status, out, _ = post_json(f"{url}/v1/responses", body, timeout=180, headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    (call,) = out["output"]
    assert (call["type"], call["name"], out["status"]) == ("function_call", "temperature", "completed"), out
    assert json.loads(call["arguments"]) in ({"unit": "c"}, {"unit": "f"})
    # the output text's log probabilities (include): one entry per output token, greedy: each
    # token its position's most likely
    body = {"model": MODEL, "input": "Say something.", "max_output_tokens": 5, "temperature": 0, "ignore_eos": True,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    status, out, _ = post_json(f"{url}/v1/responses", body, timeout=180, headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    lps = out["output"][0]["content"][0]["logprobs"]
    assert len(lps) == out["usage"]["output_tokens"] == 5, out
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in lps), lps


def test_logprobs_through_the_cluster(url):
    """Chat logprobs from vLLM through the replica's coalesced stream: one entry per counted token,
    each with the asked alternatives, most likely first, the greedy pick as likely as the first
    (the tiny model's near-uniform weights often tie it with another token)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count: one two three"}], "max_tokens": 6,
            "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    status, out, _ = post_json(f"{url}/v1/chat/completions", body, timeout=180,
                               headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 6
    for e in content:
        values = [a["logprob"] for a in e["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True) and e["logprob"] == values[0] <= 0


def test_scoring_a_text_echo_with_logprobs_and_a_streamed_answers_logprobs(url):
    """How evaluation harnesses score a text (echo, logprobs, one token): the prompt's tokens
    first, the first without a log probability, each other with its alternative; and a stream's
    log probabilities arrive one per token through the replica's coalescing."""
    prompt = prompt_ids(13, 40)
    status, out, _ = complete(url, prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    body = json.dumps({"model": MODEL, "prompt": prompt_ids(5, 300), "max_tokens": 12, "stream": True,
                       "logprobs": 2, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json",
                                                                             "authorization": f"Bearer {ALICE}"})
    with urllib.request.urlopen(req, timeout=180) as r:
        events = [json.loads(ln.decode()[6:]) for ln in r if ln.startswith(b"data: {")]
    entries = [v for e in events if e["choices"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(entries) == events[-1]["usage"]["completion_tokens"] == 12


def test_too_long_prompt_is_400(url):
    status, body, _ = complete(url, prompt_ids(9, MAX_MODEL_LEN - 4), max_tokens=8)
    assert status == 400
    assert f"maximum context length is {MAX_MODEL_LEN}" in body["error"]["message"]


def test_tenants_never_hit_each_others_cached_prefixes(url):
    """The prefix-cache timing side channel, closed: alice's repeat of a 2,100-token prefix hits
    vLLM's cache (cached_tokens > 0, a short time to first token); bob's identical prompt right
    after hits nothing (cached_tokens 0, a cold time to first token), then hits his own copy.
    Without a key: 401."""
    shared = prompt_ids(3, PREFIX)
    ask = {"max_tokens": 1}
    _, a1, _ = complete(url, shared + prompt_ids(301, 20), key=ALICE, **ask)
    _, a2, _ = complete(url, shared + prompt_ids(302, 20), key=ALICE, **ask)
    _, b1, _ = complete(url, shared + prompt_ids(302, 20), key=BOB, **ask)
    _, b2, _ = complete(url, shared + prompt_ids(303, 20), key=BOB, **ask)
    hit = PREFIX // VLLM_CPU_BLOCK * VLLM_CPU_BLOCK

    def cached(r: dict) -> int:
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(r) for r in (a1, a2, b1, b2)] == [0, hit, 0, hit]
    ttft = {k: r["fairway"]["ttft_s"] for k, r in {"a1": a1, "a2": a2, "b1": b1, "b2": b2}.items()}
    print("tenants' TTFT (s):", {k: round(v, 4) for k, v in ttft.items()})
    # bob's first is a cold prefill, slower than alice's hit (bob's own hit after it is not compared:
    # on 2 cores shared with the rest of the suite one hit took 0.18 s against his cold 0.07 s)
    assert ttft["b1"] > ttft["a2"], ttft
    status, body, _ = post_json(f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert status == 401 and body["error"]["message"].startswith("missing API key")


def _engine_core_pids() -> list[int]:
    """vLLM's engine-core processes (their title is ``VLLM::EngineCore``)."""
    import os

    pids = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineCore" in f.read(300):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_zz_killing_the_engine_process_fails_requests_clearly_and_the_replica_is_replaced(url):
    """Last in the module (it takes the engine down): kill -9 vLLM's engine-core process under the
    replica. Requests then get a 503 with a message at once (no hang) until Serve, whose health
    check now fails, has replaced the replica; then they are served again."""
    import os
    import signal

    pids = _engine_core_pids()
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    statuses = []
    while time.monotonic() - t0 < 420:
        t1 = time.monotonic()
        status, body, _ = complete(url, prompt_ids(77, 50), max_tokens=2)
        assert time.monotonic() - t1 < 60, "a request hung on the dead engine"
        statuses.append(status)
        if status == 200:
            break
        assert status == 503 and body["error"]["message"], (status, body)
        time.sleep(2)
    print(f"engine killed: {statuses.count(503)} x 503, then served after {time.monotonic() - t0:.0f} s")
    assert statuses[-1] == 200 and 503 in statuses, statuses
