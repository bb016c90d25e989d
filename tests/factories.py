"""Test factories and fakes that implement the real interfaces (docs/design.md, Tests with factories and fakes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

from fairway.clock import ManualClock
from fairway.policies import QueuedRequest, QueuePolicy, make_policy
from fairway.request import RequestSpec, Workload


class LinearCost:
    """A cost model with round numbers: prefill = overhead + per_token * new tokens.

    Implements the CostModel interface the policies and the engine use."""

    name = "linear-test"

    def __init__(self, per_token: float = 0.001, overhead: float = 0.01, decode: float = 0.005):
        self.per_token = per_token
        self.overhead = overhead
        self.decode = decode

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        return self.overhead + self.per_token * new_tokens

    def prefill_time_array(self, new_tokens, cached_tokens):
        return self.overhead + self.per_token * new_tokens

    def chunked_prefill_time(self, new_tokens: int, cached_tokens: int, chunk_tokens: int,
                             decode_seqs: int = 0, decode_ctx_tokens: int = 0) -> float:
        """One overhead (and decode cost) per step of at most ``chunk_tokens`` (``CostModel``'s
        rule, linear)."""
        n = max(1, new_tokens)
        steps = -(-n // chunk_tokens) if chunk_tokens > 0 else 1
        return steps * (self.overhead + (self.decode if decode_seqs else 0)) + self.per_token * n

    def step_time(self, prefill_tokens, prefill_ctx_tokens, prefill_sq_tokens, decode_seqs,
                  decode_ctx_tokens) -> float:
        return self.overhead + self.per_token * prefill_tokens + (self.decode if decode_seqs else 0)

    def default_kv_blocks(self, block_size: int = 16, gpu_memory_utilization: float = 0.9) -> int:
        return 10_000

    def kv_bytes_per_token(self) -> int:
        return 1


def chain(prefix: str, n: int, start: int = 0) -> list[int]:
    """Readable fake block hashes: blocks of a prompt family ``prefix``. Distinct families never
    share a hash; a family's first k blocks are shared by all its members."""
    base = sum(ord(c) * 1000**i for i, c in enumerate(prefix)) * 10_000
    return [base + i for i in range(start, start + n)]


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids of prompt family ``seed`` for the end-to-end tests, inside both tiny
    vocabularies (the tokenizer's and the tiny Llama's): different families differ from their
    first block, so each is cold until sent once."""
    return [16 + (seed * 7919 + i * 31) % 4000 for i in range(n)]


def queued(rid: int, arrival: float, prompt: int, hashes: Sequence[int] = (), seq: int | None = None,
           ) -> QueuedRequest:
    return QueuedRequest(rid=rid, arrival_s=arrival, prompt_tokens=prompt,
                         block_hashes=list(hashes), seq=rid if seq is None else seq)


def policy_with_cache(name: str, cached: set[int], clock: ManualClock | None = None,
                      cost: LinearCost | None = None, **kw) -> tuple[QueuePolicy, ManualClock]:
    clock = clock or ManualClock()
    p = make_policy(name, clock=clock, cost=cost or LinearCost(), block_size=16, **kw)  # type: ignore[arg-type]
    p.attach_cache(cached.__contains__)
    return p, clock


def drain_order(p: QueuePolicy, clock: ManualClock | None = None, dt: float = 0.0) -> list[int]:
    """Admit everything, in the policy's order; advance the clock by ``dt`` per admission."""
    out = []
    while len(p):
        r = p.select()
        assert r is not None
        p.admit(r.rid)
        out.append(r.rid)
        if clock is not None and dt:
            clock.advance(dt)
    return out


def spec(rid: int, arrival: float, prompt: int, output: int, hashes: Sequence[int], kind: str = ""
         ) -> RequestSpec:
    return RequestSpec(rid=rid, arrival_s=arrival, prompt_tokens=prompt, output_tokens=output,
                       block_hashes=tuple(hashes), kind=kind)


class ListWorkload(Workload):
    """An open-loop workload over a fixed list of specs."""

    name = "list"

    def __init__(self, specs: Sequence[RequestSpec]):
        self.specs = sorted(specs, key=lambda s: (s.arrival_s, s.rid))

    def initial(self) -> Iterator[RequestSpec]:
        return iter(self.specs)


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 5.0) -> None:
    """Poll ``cond`` on the running loop until it holds, or fail naming ``what`` after
    ``deadline_s`` (the loop turns between polls: the tasks under test run)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(0.001)

