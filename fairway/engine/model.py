"""Engine model: one vLLM-v1-like replica (prefix cache, continuous batching, chunked prefill).

Per step (``start_step``), as vLLM v1's scheduler does:
1. Running requests first, in admission order: a prefilling request gets its next chunk (up to
   the remaining token budget), a decoding request 1 token. A request that needs a new KV block
   when none is free preempts the policy's victim (default: the newest running request), which
   releases its blocks and goes back to the waiting queue for recompute. A step that preempted
   admits nothing new.
2. Then waiting requests, in the policy's order, while budget and ``max_num_seqs`` allow.
   **Memory decides admission**: the head request is admitted only if blocks for its whole
   prompt (beyond its cache hit) fit in the free pool; otherwise admission stops for this step
   (head-of-line, as vLLM's scheduler ``break``s).
3. Step time comes from the cost model on the batch aggregates; ``finish_step`` applies the
   step's effects at its end time: computed tokens advance, newly full blocks enter the prefix
   cache, first tokens and finishes are stamped.

Deviation from vLLM v1, stated: vLLM allocates blocks chunk by chunk; we reserve the whole prompt
at admission (vLLM v0's ``can_allocate``), which avoids preemption storms from half-admitted
prompts and makes the admission limit explicit.

The waiting queue *is* the policy object, so the same policy code orders admission here, in the
replica gate and in the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.engine.block_pool import BlockPool
from fairway.policies.base import QueuedRequest, QueuePolicy
from fairway.request import RequestSpec


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits (vLLM names and defaults).

    block_size: tokens per KV block (16).
    max_num_batched_tokens: per-step token budget for chunked prefill + decode (8192).
    max_num_seqs: most requests running at once (256).
    kv_blocks: KV capacity in blocks; None derives it from GPU memory via the cost profile.
    """

    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("engine limits must be positive")
        if self.kv_blocks is not None and self.kv_blocks <= 0:
            raise ValueError("kv_blocks must be positive")


@dataclass(slots=True)
class EngineRequest:
    """A request inside the engine, and its record.

    Invariants: ``num_computed <= prompt + generated``; ``generated <= output``;
    ``len(blocks) * block_size >= num_computed``; times are non-decreasing
    arrival <= admitted <= first_token <= finished once set.
    """

    spec: RequestSpec
    seq: int
    replica: int = 0
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    generated: int = 0
    n_hashed: int = 0
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finished_s: float = -1.0
    preemptions: int = 0
    cached_tokens: int = -1  # prefix-cache hit at first admission
    lane: str = ""
    promoted: bool = False
    uncached_at_arrival: int = 0
    est_prefill_at_arrival_s: float = 0.0
    rejected: str = ""
    aborted: bool = False  # the host gave up on it (its client left) before it finished

    @property
    def rid(self) -> int:
        return self.spec.rid

    @property
    def target(self) -> int:
        """Tokens known so far: the prompt plus generated output."""
        return self.spec.prompt_tokens + self.generated

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.spec.arrival_s


class EngineModel:
    """One replica's engine. Host protocol: ``add`` arrivals; when idle and ``has_work()``,
    ``start_step()`` returns the step duration; at its end, ``finish_step()`` returns the requests
    that finished."""

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        policy: QueuePolicy,
        clock: Clock,
        replica: int = 0,
    ) -> None:
        self.config = config
        self.cost = cost
        self.policy = policy
        self.clock = clock
        self.replica = replica
        bs = config.block_size
        n_blocks = config.kv_blocks or cost.default_kv_blocks(bs)
        self.pool = BlockPool(n_blocks, bs)
        policy.attach_cache(self.pool.__contains__)
        self.reqs: dict[int, EngineRequest] = {}  # waiting + running
        self.running: list[EngineRequest] = []
        self._batch: list[tuple[EngineRequest, int]] = []
        self._seq = 0
        self.listener: Any = None  # optional lifecycle observer (the cluster router host)
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # time in steps that computed prompt tokens
        self.steps = 0
        self.preemptions = 0

    # -- arrivals ----------------------------------------------------------------------------

    def add(self, spec: RequestSpec) -> EngineRequest:
        """Queue an arriving request. A request that cannot fit in the whole KV cache is
        rejected (returned with ``rejected`` set) instead of blocking the queue forever."""
        bs = self.config.block_size
        r = EngineRequest(spec=spec, seq=self._seq, replica=self.replica)
        self._seq += 1
        need = -(-(spec.prompt_tokens + spec.output_tokens) // bs)
        if need > self.pool.num_blocks:
            r.rejected = f"needs {need} KV blocks, engine has {self.pool.num_blocks}"
            if self.listener is not None:
                self.listener.on_finished(self.replica, r)
            return r
        hit = len(self.pool.longest_hit(self._cacheable(r)))
        c = hit * bs
        r.uncached_at_arrival = spec.prompt_tokens - c
        r.est_prefill_at_arrival_s = self.cost.prefill_time(spec.prompt_tokens - c, c)
        self.reqs[spec.rid] = r
        self._enqueue(r)
        return r

    def _enqueue(self, r: EngineRequest) -> None:
        n_known = r.target
        bs = self.config.block_size
        self.policy.add(
            QueuedRequest(
                rid=r.rid,
                arrival_s=r.spec.arrival_s,
                prompt_tokens=n_known,
                block_hashes=r.spec.block_hashes[: n_known // bs],
                seq=r.seq,
                output_tokens=r.spec.output_tokens,
                session=r.spec.session,
            )
        )

    def _cacheable(self, r: EngineRequest) -> tuple[int, ...]:
        n = max(0, (r.target - 1) // self.config.block_size)
        return r.spec.block_hashes[:n]

    # -- steps -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running) or len(self.policy) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def scheduled(self) -> list[EngineRequest]:
        """The requests in the step ``start_step`` scheduled and ``finish_step`` will apply
        (real-time hosts read it to know whose tokens a step produced)."""
        return [r for r, _ in self._batch]

    def start_step(self) -> float | None:
        """Schedule one step at the current time; return its duration, or None if nothing
        could be scheduled."""
        now = self.clock.now()
        cfg = self.config
        bs = cfg.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[EngineRequest, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.target - r.num_computed, budget)
            need = -(-(r.num_computed + n) // bs) - len(r.blocks)
            victim_is_r = False
            while need > pool.num_free:
                v = self.policy.preempt_victim([x.rid for x in self.running])
                victim = self.running[v]
                self._preempt(victim)
                preempted += 1
                if victim is r:
                    victim_is_r = True
                    break
                if v < i:
                    i -= 1
            if victim_is_r:
                continue
            if need > 0:
                r.blocks.extend(pool.allocate(need))
                self._flush_events()
            batch.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            while budget > 0 and len(self.running) < cfg.max_num_seqs:
                q = self.policy.select()
                if q is None:
                    break
                r = self.reqs[q.rid]
                hit = pool.longest_hit(self._cacheable(r))
                new_blocks = -(-r.target // bs) - len(hit)
                if pool.free_after_touch(hit) < new_blocks:
                    break  # memory-bound admission: the head waits for room
                adm = self.policy.admit(q.rid)
                pool.touch(hit)
                r.blocks = list(hit) + pool.allocate(new_blocks)
                self._flush_events()
                r.num_computed = len(hit) * bs
                r.n_hashed = len(hit)
                if r.admitted_s < 0:
                    r.admitted_s = now
                    r.cached_tokens = r.num_computed
                    r.lane = adm.lane
                    r.promoted = adm.promoted
                self.running.append(r)
                if self.listener is not None:
                    self.listener.on_admitted(self.replica, r)
                n = min(r.target - r.num_computed, budget)
                batch.append((r, n))
                budget -= n
        if not batch:
            self._batch = []
            return None
        p_tok = p_ctx = p_sq = d_seqs = d_ctx = 0
        for r, n in batch:
            if r.num_computed + n == r.target and n == 1 and r.generated > 0:
                d_seqs += 1
                d_ctx += r.num_computed
            else:
                p_tok += n
                p_ctx += n * r.num_computed
                p_sq += n * n
        dt = self.cost.step_time(p_tok, p_ctx, p_sq, d_seqs, d_ctx)
        self._batch = batch
        self.policy.on_step(p_tok)
        self.steps += 1
        self.busy_s += dt
        if p_tok:
            self.prefill_busy_s += dt
        return dt

    def finish_step(self) -> list[EngineRequest]:
        """Apply the scheduled step at its end time (the clock's now)."""
        now = self.clock.now()
        bs = self.config.block_size
        pool = self.pool
        done: list[EngineRequest] = []
        for r, n in self._batch:
            r.num_computed += n
            hashes = r.spec.block_hashes
            full = min(r.num_computed // bs, len(hashes))
            for k in range(r.n_hashed, full):
                pool.cache_block(r.blocks[k], hashes[k])
            r.n_hashed = max(r.n_hashed, full)
            if r.num_computed == r.target:
                r.generated += 1
                if r.first_token_s < 0:
                    r.first_token_s = now
                if r.generated >= r.spec.output_tokens:
                    r.finished_s = now
                    done.append(r)
        self._batch = []
        if done:
            finished = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in finished]
            for r in done:
                pool.release(r.blocks)
                r.blocks = []
                del self.reqs[r.rid]
                if self.listener is not None:
                    self.listener.on_finished(self.replica, r)
        self._flush_events()
        return done

    def abort(self, rid: int) -> bool:
        """Stop request ``rid`` wherever it is (waiting, running, or in the step now in flight;
        the step's cost is already spent, its work on this request is dropped): its queue entry
        and KV blocks are freed at once, the blocks it completed stay cached (as vLLM keeps the
        computed prefix of an aborted request). False if it is not here (finished, or unknown).
        O(running + waiting) for the queue and batch removals."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return False
        r.aborted = True
        running = [x for x in self.running if x is not r]
        if len(running) < len(self.running):
            self.running = running
        else:
            self.policy.remove(rid)
        self._batch = [(x, n) for x, n in self._batch if x is not r]
        self.pool.release(r.blocks)
        r.blocks = []
        self._flush_events()
        if self.listener is not None:
            self.listener.on_finished(self.replica, r)
        return True

    # -- internals ---------------------------------------------------------------------------

    def _preempt(self, r: EngineRequest) -> None:
        self.running.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.n_hashed = 0
        r.preemptions += 1
        self.preemptions += 1
        self._enqueue(r)
        if self.listener is not None:
            self.listener.on_preempted(self.replica, r)

    def _flush_events(self) -> None:
        events = self.pool.drain_events()
        if not events:
            return
        if self.listener is not None:
            self.listener.on_kv_events(self.replica, events)
        run: list[int] = []
        kind = events[0][0]
        for stored, h in events:
            if stored != kind:
                self._deliver(kind, run)
                run = []
                kind = stored
            run.append(h)
        self._deliver(kind, run)

    def _deliver(self, stored: bool, hashes: list[int]) -> None:
        if stored:
            self.policy.on_blocks_stored(hashes)
        else:
            self.policy.on_blocks_removed(hashes)
