"""The same requests to vLLM's own OpenAI server and to a Fairway cluster on vLLM: do they answer alike?

``python -m bench.vllm_parity --vllm http://127.0.0.1:8100 --ours http://127.0.0.1:8000`` sends
each case of ``CASES`` (greedy, so both engines compute the same tokens from the same weights) to
both and compares what a client reads: the text, the prompt's token count, vLLM's
``prompt_logprobs`` (each position's token ids, log probabilities to 3 decimals, ranks, texts),
the output log probabilities' token names, and the status of what both must refuse; then
``/tokenize``'s ids. It prints one line per case and exits 1 when any differs.

Not compared: a forced tool call (vLLM 0.32 needs a tool-call parser for ``tool_choice:
"required"``, and its ``llama3_json`` parser needs a ``<|python_tag|>`` token that fairway-tiny's
tokenizer has not).

vLLM's own server on the same tiny model (CPU, about a minute to start; the cluster:
``FAIRWAY_CONFIG=deploy/cluster-vllm-cpu.yaml scripts/run.sh up``):

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/vllm serve deploy/models/fairway-tiny-llama \\
        --tokenizer deploy/models/fairway-tiny --served-model-name fairway-tiny --port 8100 \\
        --max-model-len 4096 --enforce-eager
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import requests

MODEL = "fairway-tiny"
TEN = "one two three four five six seven eight nine ten"
CHAT = [{"role": "user", "content": "hi"}]

#: (name, path, body): vLLM's request options, each on its own, greedy
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("completion prompt_logprobs", "/v1/completions", {"prompt": "hello there friend", "max_tokens": 3,
                                                      "prompt_logprobs": 2}),
    ("chat prompt_logprobs", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "prompt_logprobs": 1}),
    ("truncate_prompt_tokens, left", "/v1/completions", {"prompt": TEN, "max_tokens": 4, "truncate_prompt_tokens": 5,
                                                         "truncation_side": "left"}),
    ("truncate_prompt_tokens, default side", "/v1/completions", {"prompt": TEN, "max_tokens": 4,
                                                                 "truncate_prompt_tokens": 5}),
    ("truncate_prompt_tokens, right", "/v1/completions", {"prompt": TEN, "max_tokens": 4, "truncate_prompt_tokens": 5,
                                                          "truncation_side": "right"}),
    ("allowed_token_ids, skip_special_tokens false", "/v1/completions", {
        "prompt": "hello", "max_tokens": 6, "allowed_token_ids": [4, 300], "skip_special_tokens": False,
        "ignore_eos": True}),
    ("return_tokens_as_token_ids", "/v1/completions", {"prompt": "hello", "max_tokens": 3, "logprobs": 1,
                                                       "return_tokens_as_token_ids": True}),
    ("bad_words", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
                                           "bad_words": ["Normal"]}),
    ("chat add_special_tokens", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                        "add_special_tokens": True}),
    ("echo with logprobs", "/v1/completions", {"prompt": "hello there", "max_tokens": 2, "echo": True, "logprobs": 1}),
    ("min_tokens, stop_token_ids", "/v1/completions", {"prompt": "hello", "max_tokens": 8, "min_tokens": 3,
                                                       "stop_token_ids": [2754]}),
    ("prompt_logprobs on a stream (refused)", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                                                  "prompt_logprobs": 1}),
    ("stop, include_stop_str_in_output", "/v1/completions", {"prompt": "hello there friend", "max_tokens": 12,
                                                             "stop": ["extr"], "include_stop_str_in_output": True}),
    ("logit_bias", "/v1/completions", {"prompt": "hello there friend", "max_tokens": 4, "logit_bias": {"2754": -100}}),
    ("seeded sampling, top_k, min_p", "/v1/completions", {"prompt": "hello", "max_tokens": 8, "temperature": 1.0,
                                                          "seed": 3, "top_k": 50, "min_p": 0.01}),
    ("n = 2 with a seed", "/v1/completions", {"prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 11,
                                              "n": 2}),
    ("response_format json_schema", "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 12, "response_format": {"type": "json_schema", "json_schema": {
            "name": "yn", "schema": {"type": "string", "enum": ["yes", "no"]}}}}),
    ("structured_outputs choice", "/v1/completions", {"prompt": "hello", "max_tokens": 8,
                                                      "structured_outputs": {"choice": ["red", "green"]}}),
    ("continue_final_message", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
        "max_tokens": 4, "continue_final_message": True, "add_generation_prompt": False}),
    ("chat logprobs, top_logprobs", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                             "top_logprobs": 2}),
]
TOKENIZE = [{"prompt": "hello there"}, {"prompt": "hello there", "add_special_tokens": False}, {"messages": CHAT}]


def seen(status: int, body: Any) -> Any:
    """What a client reads of an answer, for the comparison (the status alone for a refusal)."""
    if status != 200:
        return status
    ch = body["choices"][0]
    out: dict[str, Any] = {"texts": [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]],
                           "finish": [c["finish_reason"] for c in body["choices"]],
                           "prompt_tokens": body["usage"]["prompt_tokens"],
                           "completion_tokens": body["usage"]["completion_tokens"]}
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in (ch.get("message") or {}).get("tool_calls")
             or ()]
    if calls:
        out["tool_calls"] = calls
    plp = ch.get("prompt_logprobs") or body.get("prompt_logprobs")
    if plp is not None:
        out["prompt_logprobs"] = [None if e is None else {k: (round(v["logprob"], 3), v["rank"], v["decoded_token"])
                                                          for k, v in e.items()} for e in plp]
    if isinstance(ch.get("logprobs"), dict) and "tokens" in ch["logprobs"]:
        out["logprob_tokens"] = ch["logprobs"]["tokens"]
    if isinstance(ch.get("logprobs"), dict) and "content" in ch["logprobs"]:
        out["logprob_tokens"] = [(e["token"], round(e["logprob"], 3), [a["token"] for a in e["top_logprobs"]])
                                 for e in ch["logprobs"]["content"]]
    return out


def ask(base: str, path: str, body: dict[str, Any]) -> Any:
    r = requests.post(base + path, json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    if body.get("stream") and r.ok:
        return "a stream"
    return seen(r.status_code, r.json())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default="http://127.0.0.1:8100", help="vLLM's own OpenAI server")
    ap.add_argument("--ours", default="http://127.0.0.1:8000", help="the Fairway cluster on vLLM")
    a = ap.parse_args()
    differ = 0
    for name, path, body in CASES:
        theirs, ours = ask(a.vllm, path, body), ask(a.ours, path, body)
        differ += theirs != ours
        print(f"{'same' if theirs == ours else 'DIFFERENT':9} {name}" + ("" if theirs == ours else
              f"\n  vllm: {json.dumps(theirs)[:300]}\n  ours: {json.dumps(ours)[:300]}"))
    for body in TOKENIZE:
        theirs = requests.post(a.vllm + "/tokenize", json={"model": MODEL, **body}, timeout=60).json().get("tokens")
        ours = requests.post(a.ours + "/tokenize", json={"model": MODEL, **body}, timeout=60).json().get("tokens")
        differ += theirs != ours
        print(f"{'same' if theirs == ours else 'DIFFERENT':9} /tokenize {json.dumps(body)}")
    print(f"{len(CASES) + len(TOKENIZE) - differ} of {len(CASES) + len(TOKENIZE)} the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
