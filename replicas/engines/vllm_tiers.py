"""Strict-tier prefill for vLLM: a scheduler that runs no lower tier's prefill while tier 0 has some.

Why: vLLM's priority scheduling (``scheduling_policy="priority"``) orders its *waiting* queue by
priority, but each step first gives the token budget to the *running* requests, whatever their
priority (vllm-project/vllm, ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``: the
running loop, then the waiting loop; a waiting request never preempts, only a running request's
failed allocation does). So an interactive prompt that arrives while a long batch prompt is being
prefilled in chunks waits for the rest of that prefill, or shares every step with its chunks.
With ``replica.strict_tiers`` on the vLLM engine the replica starts vLLM with this scheduler
(``scheduler_cls``) and submits each request with ``priority`` = its class's tier less the
strictest configured tier, so tier 0 is the strictest. The rule, the same as the engine model's
``EngineConfig.strict_prefill_first`` (docs/design.md, Flow control, Inside the engine): in a step
where a tier-0 request has prefill to run (one waits, or one running is not past its prompt), no
request of a lower tier (``priority > 0``) gets a prefill chunk or is admitted. Decodes of every
tier go on.

How, without copying vLLM's loop: before ``schedule`` it marks the lower tiers' running prefill
chunks not eligible for this one step (``next_decode_eligible_step``, the field vLLM's own
pipeline-parallel and diffusion schedulers use the same way: ``current_step + 2`` skips exactly
the coming call, and ``max`` keeps a longer wait), and ``_handle_blocked_waiting_request`` (vLLM's
hook for a waiting request that may not start yet) defers the lower tiers' waiting requests for
the step. They keep their place: a marked running request stays in ``running`` (so it is still a
preemption victim before any tier-0 request), a deferred waiting one goes back to the queue.

Liveness: a tier-0 request that waits for KV memory is not admitted, and only decodes free memory;
if lower-tier prefills held it and nothing decoded, the rule would stall the engine. So a step
that applied the rule and scheduled no tier-0 prefill lets the next step run without it.

Cost per step: O(running) to find tier-0 prefill (vLLM's own step is O(running) too) and the
waiting queues' heads; in a step that applies the rule, O(running + scheduled) more, and the
lower tiers' waiting requests popped and put back as vLLM does for any deferred request.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class _StrictTiers:
    """The rule above, over vLLM's ``Scheduler``; mixed into the synchronous and the async one."""

    _strict_now = False  # this step defers the lower tiers (read by the waiting-queue hook)
    _strict_stalled = False  # the last strict step scheduled no tier-0 prefill: skip the rule once
    strict_steps = 0  # steps that applied the rule (tests, logs)

    def _tier0_has_prefill(self) -> bool:
        """Whether a tier-0 request is running with prefill left, or waits."""
        return (any(r.priority <= 0 and r.is_prefill_chunk for r in self.running)
                or any(q and q.peek_request().priority <= 0 for q in (self.waiting, self.kv_holding_waiting)))

    def schedule(self, throttle_prefills: bool = False) -> Any:
        if self._strict_stalled or not self._tier0_has_prefill():
            self._strict_stalled = False
            return super().schedule(throttle_prefills)
        skip = self.current_step + 2  # schedule() advances current_step, then skips steps below this
        for r in self.running:
            if r.priority > 0 and r.is_prefill_chunk and r.next_decode_eligible_step < skip:
                r.next_decode_eligible_step = skip
        self._strict_now = True
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self._strict_now = False
        self.strict_steps += 1
        # schedule() has advanced each scheduled request's computed tokens: a tier-0 request
        # whose scheduled tokens started before the end of its prompt got prefill
        requests = self.requests
        self._strict_stalled = not any(
            r.priority <= 0 and r.num_computed_tokens - n < r.num_prompt_tokens
            for r, n in ((requests[rid], n) for rid, n in out.num_scheduled_tokens.items()))
        return out

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        ready = super()._handle_blocked_waiting_request(request)
        return ready and not (self._strict_now and request.priority > 0)


class StrictTierScheduler(_StrictTiers, Scheduler):
    """vLLM's synchronous scheduler with strict-tier prefill."""


class AsyncStrictTierScheduler(_StrictTiers, AsyncScheduler):
    """vLLM's async scheduler (its default where the executor supports it) with strict-tier prefill."""


def strict_tier_scheduler(async_scheduling: bool) -> type[Scheduler]:
    """The class to give vLLM's ``scheduler_cls``: the one matching its async scheduling setting.
    ``RuntimeError`` where this vLLM's scheduler lacks either hook the rule relies on (another
    vLLM version), so the engine fails at start with the reason instead of serving without it."""
    missing = [name for name, ok in (
        ("Scheduler._handle_blocked_waiting_request", hasattr(Scheduler, "_handle_blocked_waiting_request")),
        ("the running loop's next_decode_eligible_step test",
         "next_decode_eligible_step" in inspect.getsource(Scheduler.schedule))) if not ok]
    if missing:
        raise RuntimeError(f"replica.strict_tiers: this vLLM's scheduler lacks {' and '.join(missing)}; "
                           "turn strict tiers off (replica.strict_tiers: false) or use a vLLM that has them "
                           "(tested: 0.32)")
    return AsyncStrictTierScheduler if async_scheduling else StrictTierScheduler


__all__ = ["AsyncStrictTierScheduler", "StrictTierScheduler", "strict_tier_scheduler"]
