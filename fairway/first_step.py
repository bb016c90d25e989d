"""The first-step hold: whether to keep a prompt out of a step that brings others' first tokens.

Why: an engine with a per-step token budget (vLLM's chunked prefill) fills a step with a chunk of
any prompt it admits. When the step already carries ``m`` requests whose prefill ends in it (they
get their first token at its end), the chunk makes each of them wait ``t1 - t0`` more (the step
with the chunk against the step without it). Holding the prompt back one step costs it about one
step, ``t0``, whether or not its own prefill would have ended in this step: its first token then
comes after the next step instead of this one. And the shorter step leaves budget unused, so the
same work takes one more step's fixed cost in all, ``L = t(chunk alone) + t0 - t1``, which delays
every request still waiting behind it. The hold pays, in the sum of first-token times, when

    m * (t1 - t0) > t0 + waiting * L.

Under a deep backlog ``waiting * L`` dominates and the engine keeps its steps full (throughput
first); in a burst on a lightly queued replica the cheap requests are spared a step lengthened by
a longer prompt: by a chunk of one that cannot finish in the step, or by the whole of one that
would (the step is then ordered shortest first, one step apart). A pick about as cheap as the
step's own prefills is not held: its chunk adds less than ``t0 / m``. A prompt that would end in
the step is held once at most, since the price counts one step's wait; held again behind each new
cheap arrival, its wait would compound unpriced. The hosts (the engine model, the replica gate)
count ``m`` and ``waiting``; the queue policy says who may be held at all
(``QueuePolicy.may_hold_first_step``: with Fairway, a request that is not promoted and has waited
less than its own prefill time, so holds at most double its wait measured against its cost).

On by default (``FairwayConfig.first_step_hold``).

Complexity: O(1), three step-time evaluations; called only while the step brings a first token.
"""

from __future__ import annotations

from fairway.cost_model import CostModel


def first_step_hold_pays(
    cost: CostModel,
    first_tokens: int,
    waiting: int,
    prefill_tokens: int,
    prefill_ctx_tokens: int,
    prefill_sq_tokens: int,
    decode_seqs: int,
    decode_ctx_tokens: int,
    chunk_tokens: int,
    chunk_ctx_tokens: int,
) -> bool:
    """Whether holding a prompt's ``chunk_tokens`` chunk (at ``chunk_ctx_tokens`` of context
    already computed; the chunk is the step's remaining budget, or less where the prompt ends in
    it) out of the step lowers the sum of first-token times (module docstring).

    The step so far is given by ``CostModel.step_time``'s aggregates; ``first_tokens`` of its
    requests get their first token at its end; ``waiting`` requests wait behind the held one.
    """
    if first_tokens <= 0 or chunk_tokens <= 0:
        return False
    n, c = chunk_tokens, chunk_ctx_tokens
    t0 = cost.step_time(prefill_tokens, prefill_ctx_tokens, prefill_sq_tokens, decode_seqs, decode_ctx_tokens)
    t1 = cost.step_time(prefill_tokens + n, prefill_ctx_tokens + n * c, prefill_sq_tokens + n * n,
                        decode_seqs, decode_ctx_tokens)
    lost = cost.step_time(n, n * c, n * n, 0, 0) + t0 - t1
    if lost < 0.0:
        lost = 0.0
    return first_tokens * (t1 - t0) > t0 + waiting * lost
