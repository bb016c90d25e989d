"""``bench.vllm_parity``'s reading of an answer: what a client sees, refusals by their status."""

from __future__ import annotations

from bench.vllm_parity import CASES, seen


def test_an_answer_is_read_as_a_client_reads_it_and_a_refusal_by_its_status():
    whole = {"choices": [{"text": "ab", "finish_reason": "length", "logprobs": {"tokens": ["a", "b"]},
                          "prompt_logprobs": [None, {"7": {"logprob": -1.23456, "rank": 2, "decoded_token": "x"}}]},
                         {"text": "cd", "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 2, "completion_tokens": 4}}
    assert seen(200, whole) == {"texts": ["ab", "cd"], "finish": ["length", "stop"], "prompt_tokens": 2,
                                "completion_tokens": 4, "logprob_tokens": ["a", "b"],
                                "prompt_logprobs": [None, {"7": (-1.235, 2, "x")}]}
    chat = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "logprobs": {"content": [
                {"token": "h", "logprob": -0.12345, "top_logprobs": [{"token": "h"}, {"token": "j"}]}]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}, "prompt_logprobs": [None]}
    assert seen(200, chat) == {"texts": ["hi"], "finish": ["stop"], "prompt_tokens": 5, "completion_tokens": 1,
                               "prompt_logprobs": [None], "logprob_tokens": [("h", -0.123, ["h", "j"])]}
    assert seen(400, {"error": {"message": "no"}}) == 400
    assert len({name for name, _, _ in CASES}) == len(CASES)  # each case named once
