"""Offline planning of a backlog under a KV budget: Sorted-F, its baselines, an executor and a
lower bound (docs/design.md, SVF and Sorted-F).

A backlog is n requests all present at t = 0, each with a prompt length s and an output length
o (known: this is the offline problem). A *plan* is a sequence of batches. A batch is feasible
when its members' whole final footprints fit at once, ``sum ceil((s + o) / block) <= kv_blocks``,
and it has at most ``max_num_seqs`` members: reserving the final footprint is what lets a batch
run without preemption.

Planners (``PLANNERS``):

- ``sorted-f``: repeatedly take, from what is left, the feasible batch X minimising
  F(X) = sum_{i in X} o_i / |X|^2 (Smith's ratio rule for batches: mean output, a proxy for the
  batch's duration, over the batch's size), exactly, by a knapsack DP (``min_f_batch``).
  Batches come out with non-decreasing F, hence the name.
- ``fcfs``, ``shortest-first`` (smallest o), ``svf`` (smallest volume o*s + o(o+1)/2): a fixed
  order, cut greedily into batches; a batch ends at the first request that does not fit
  (head-of-line, as an engine's admission does).

``execute`` runs a plan on a one-replica step model priced by ``CostModel.step_time``: the
engine's step rules (running requests in admission order, a prefill chunk or one decode token
each, within ``max_num_batched_tokens``), without a prefix cache (each request's KV is its own).
``static`` mode starts a batch only when the previous one has finished; ``continuous`` mode
admits the plan's requests in order whenever their footprint fits (continuous batching).

``lower_bound`` bounds the completion times of *any* schedule on that step model that never
holds more than ``kv_blocks`` blocks of KV, so every planner in either mode, and is stated there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fairway.cost_model import CostModel
from fairway.engine.model import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

STATIC = "static"
CONTINUOUS = "continuous"
MODES = (STATIC, CONTINUOUS)


@dataclass(frozen=True, slots=True)
class Job:
    """One backlog request. Invariants: ``prompt >= 1``, ``output >= 1``."""

    rid: int
    prompt: int
    output: int

    def __post_init__(self) -> None:
        if self.prompt < 1 or self.output < 1:
            raise ValueError(f"job {self.rid}: prompt and output must be >= 1")


@dataclass(frozen=True, slots=True)
class Budget:
    """The replica's limits (vLLM names). ``kv_blocks`` of ``block_size`` tokens."""

    kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        if min(self.kv_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("budget limits must be >= 1")

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def blocks(self, job: Job) -> int:
        """Blocks ``job`` holds at its end: its reservation."""
        return -(-(job.prompt + job.output) // self.block_size)

    def fits(self, job: Job) -> bool:
        return self.blocks(job) <= self.kv_blocks


Plan = list[list[int]]  # batches of indices into the backlog


def f_value(outputs: Sequence[int]) -> float:
    """Sorted-F's objective F(X) = sum of output lengths / |X|^2."""
    return sum(outputs) / len(outputs) ** 2


def volume(job: Job) -> int:
    """KV token-steps over the job's life: o * s + o (o + 1) / 2 (``fairway.policies.svf``)."""
    return job.output * job.prompt + job.output * (job.output + 1) // 2


# -- planners ------------------------------------------------------------------------------


def greedy_batches(jobs: Sequence[Job], order: Sequence[int], budget: Budget) -> Plan:
    """Cut ``order`` into consecutive batches: a batch takes requests while the next one fits.
    Every job must fit alone (``Budget.fits``). O(n)."""
    plan: Plan = []
    cur: list[int] = []
    used = 0
    for i in order:
        b = budget.blocks(jobs[i])
        if cur and (used + b > budget.kv_blocks or len(cur) >= budget.max_num_seqs):
            plan.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += b
    if cur:
        plan.append(cur)
    return plan


def plan_fcfs(jobs: Sequence[Job], budget: Budget) -> Plan:
    return greedy_batches(jobs, range(len(jobs)), budget)


def plan_shortest_first(jobs: Sequence[Job], budget: Budget) -> Plan:
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].output, i))
    return greedy_batches(jobs, order, budget)


def plan_svf(jobs: Sequence[Job], budget: Budget) -> Plan:
    order = sorted(range(len(jobs)), key=lambda i: (volume(jobs[i]), i))
    return greedy_batches(jobs, order, budget)


#: Most DP cells ``min_f_batch`` keeps (one byte each) before it coarsens the memory unit.
MAX_DP_CELLS = 64_000_000


def min_f_batch(jobs: Sequence[Job], candidates: Sequence[int], budget: Budget) -> list[int]:
    """The feasible batch among ``candidates`` with the least F, ties to the larger batch, then
    (equal sums) to earlier candidates. Returned sorted by (output, index).

    Why a DP: for each size k, the least output sum of k candidates whose blocks fit is a
    cardinality-constrained knapsack; a table dp[k][m] (least output sum of k requests within m
    blocks) gives every k at once, and F = dp[k][kv_blocks] / k^2. Cost O(n * K * C) time and
    bytes (K = most requests that fit, C = blocks); above ``MAX_DP_CELLS`` the memory unit is
    coarsened by g (weights rounded up, capacity down), which keeps every chosen batch feasible
    but makes the optimum exact only over the g-block grid.
    """
    idx = list(candidates)
    if not idx:
        return []
    w = np.array([budget.blocks(jobs[i]) for i in idx], dtype=np.int64)
    o = np.array([jobs[i].output for i in idx], dtype=np.float64)
    cap = budget.kv_blocks
    k_max = min(budget.max_num_seqs, int(np.searchsorted(np.cumsum(np.sort(w)), cap, side="right")))
    if k_max == 0:
        raise ValueError("no candidate fits the KV budget")
    g = max(1, -(-len(idx) * (k_max + 1) * (cap + 1) // MAX_DP_CELLS))
    if g > 1:
        w = -(-w // g)
        cap //= g
    dp = np.full((k_max + 1, cap + 1), np.inf)
    dp[0, :] = 0.0
    take = np.zeros((len(idx), k_max + 1, cap + 1), dtype=bool)
    for j in range(len(idx)):
        wj = int(w[j])
        if wj > cap:
            continue
        cand = dp[:-1, : cap + 1 - wj] + o[j]  # a copy: values before item j (0/1 knapsack)
        cur = dp[1:, wj:]
        better = cand < cur
        take[j, 1:, wj:] = better
        cur[better] = cand[better]
    sizes = np.arange(1, k_max + 1)
    f = dp[1:, cap] / sizes.astype(float) ** 2
    best_f = f.min()
    if not np.isfinite(best_f):  # only after coarsening: nothing fits the g-block grid
        return [min((i for i in idx if budget.fits(jobs[i])), key=lambda i: (jobs[i].output, i))]
    k = int(sizes[np.flatnonzero(f == best_f)[-1]])  # ties: the larger batch
    chosen: list[int] = []
    m = cap
    for j in range(len(idx) - 1, -1, -1):
        if k == 0:
            break
        if take[j, k, m]:
            chosen.append(idx[j])
            k -= 1
            m -= int(w[j])
    return sorted(chosen, key=lambda i: (jobs[i].output, i))


def plan_sorted_f(jobs: Sequence[Job], budget: Budget) -> Plan:
    """Sorted-F: the least-F feasible batch of what is left, repeatedly. O(batches * DP)."""
    left = list(range(len(jobs)))
    plan: Plan = []
    while left:
        batch = min_f_batch(jobs, left, budget)
        plan.append(batch)
        taken = set(batch)
        left = [i for i in left if i not in taken]
    return plan


PLANNERS: dict[str, Callable[[Sequence[Job], Budget], Plan]] = {
    "fcfs": plan_fcfs,
    "shortest-first": plan_shortest_first,
    "svf": plan_svf,
    "sorted-f": plan_sorted_f,
}


# -- executor ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What executing a plan produced. ``first_token_s`` and ``finish_s`` are per job (backlog
    order), measured from t = 0; every job finishes, so both are finite."""

    first_token_s: np.ndarray
    finish_s: np.ndarray
    steps: int
    batches: int

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max()) if self.finish_s.size else 0.0


def execute(jobs: Sequence[Job], plan: Plan, budget: Budget, cost: CostModel,
            mode: str = STATIC) -> Outcome:
    """Run ``plan`` step by step (see the module docstring for the two modes). Memory: each
    admitted job reserves ``Budget.blocks`` until it finishes, so KV never exceeds the budget.
    O(steps * running) with steps <= sum over batches of (prefill chunks + longest output)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = len(jobs)
    if sorted(i for b in plan for i in b) != list(range(n)):
        raise ValueError("the plan must hold every job exactly once")
    for b in plan:
        if sum(budget.blocks(jobs[i]) for i in b) > budget.kv_blocks or len(b) > budget.max_num_seqs:
            raise ValueError("the plan has an infeasible batch")
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    computed = [0] * n
    generated = [0] * n
    batches: deque[list[int]] = deque(plan) if mode == STATIC else deque()
    order: deque[int] = deque(i for b in plan for i in b) if mode == CONTINUOUS else deque()
    running: list[int] = []
    free = budget.kv_blocks
    t = 0.0
    steps = 0
    while running or batches or order:
        if mode == STATIC:
            if not running:
                running = list(batches.popleft())
                free -= sum(budget.blocks(jobs[i]) for i in running)
        else:
            while order and len(running) < budget.max_num_seqs and budget.blocks(jobs[order[0]]) <= free:
                i = order.popleft()
                free -= budget.blocks(jobs[i])
                running.append(i)
        tokens = budget.max_num_batched_tokens
        p_tok = p_ctx = p_sq = d_seqs = d_ctx = 0
        sched: list[tuple[int, int]] = []
        for i in running:
            if tokens <= 0:
                break
            target = jobs[i].prompt + generated[i]
            k = min(target - computed[i], tokens)
            if k == 1 and generated[i] > 0:
                d_seqs += 1
                d_ctx += computed[i]
            else:
                p_tok += k
                p_ctx += k * computed[i]
                p_sq += k * k
            sched.append((i, k))
            tokens -= k
        t += cost.step_time(p_tok, p_ctx, p_sq, d_seqs, d_ctx)
        steps += 1
        done: set[int] = set()
        for i, k in sched:
            computed[i] += k
            if computed[i] == jobs[i].prompt + generated[i]:
                generated[i] += 1
                if generated[i] == 1:
                    first[i] = t
                if generated[i] >= jobs[i].output:
                    finish[i] = t
                    done.add(i)
                    free += budget.blocks(jobs[i])
        if done:
            running = [i for i in running if i not in done]
    return Outcome(first_token_s=first, finish_s=finish, steps=steps, batches=len(plan))


# -- lower bound ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LowerBound:
    """``kth_s[k-1]`` bounds the k-th smallest completion time of any schedule; so ``sum_s``
    bounds the sum (and ``sum_s / n`` the mean) of completion times, ``kth_s[-1]`` the makespan.
    ``own_s`` is each job's own bound (alone, with unlimited batch)."""

    kth_s: np.ndarray
    own_s: np.ndarray

    @property
    def sum_s(self) -> float:
        return float(self.kth_s.sum())

    @property
    def mean_s(self) -> float:
        return self.sum_s / len(self.kth_s) if len(self.kth_s) else 0.0

    @property
    def makespan_s(self) -> float:
        return float(self.kth_s[-1]) if len(self.kth_s) else 0.0


def lower_bound(jobs: Sequence[Job], budget: Budget, cost: CostModel) -> LowerBound:
    """A lower bound on completion times of any schedule of ``jobs`` on one replica whose steps
    cost ``cost.step_time``, that computes every prompt token (no prefix cache), runs at most
    ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens per step, and never holds
    more than ``kv_tokens`` tokens of KV (every plan here, in both modes).

    Per step, ``step_time >= g(d) = oh + max(floor, max(b, W) + dec * d)`` with d the step's
    decode context (the cost model's terms), and g is convex, so n steps serving D decode
    context take at least ``n * g(D / n)``. Job i needs ``n_i = ceil(s/B) + o - 1`` steps, serves
    ``D_i = sum_{k=1..o-1} (s + k - 1)`` decode context and holds ``V_i = s + sum_{k=1..o-1}
    (s + k)`` token-steps of KV. When k jobs have finished, at least the k smallest of each
    quantity has been served, so the k-th completion is at least ``n * g(D_k / n)`` with D_k
    the k smallest D_i and n the largest of: the k-th smallest n_i, (k smallest V) / KV tokens
    (the memory-volume relaxation), (k smallest tokens s + o - 1) / B, and (k smallest n_i) /
    max_num_seqs; and at least the k-th smallest job-alone bound (the infinite-batch
    relaxation). O(n log n).
    """
    p = cost.profile
    oh, floor = p.step_overhead_s, p.launch_floor_s
    m0 = max(p.linear_s_per_token, p.weight_read_s)
    dec = max(p.attn_s_per_token_ctx, p.ctx_read_s_per_token)
    s = np.array([j.prompt for j in jobs], dtype=np.int64)
    o = np.array([j.output for j in jobs], dtype=np.int64)
    big_b = budget.max_num_batched_tokens
    n_i = -(-s // big_b) + o - 1
    d_i = (o - 1) * s + (o - 1) * (o - 2) // 2
    v_i = o * s + o * (o - 1) // 2
    t_i = s + o - 1

    def time_of(n_steps: np.ndarray, d: np.ndarray) -> np.ndarray:
        nf = n_steps.astype(float)
        return nf * oh + np.maximum(nf * floor, nf * m0 + dec * d.astype(float))

    own = time_of(n_i, d_i)

    def ceil_div(a: np.ndarray, b: int) -> np.ndarray:
        return -(-a // b)

    steps_k = np.maximum.reduce([
        np.sort(n_i),
        ceil_div(np.cumsum(np.sort(v_i)), budget.kv_tokens),
        ceil_div(np.cumsum(np.sort(t_i)), big_b),
        ceil_div(np.cumsum(np.sort(n_i)), budget.max_num_seqs),
    ])
    kth = np.maximum(time_of(steps_k, np.cumsum(np.sort(d_i))), np.sort(own))
    return LowerBound(kth_s=kth, own_s=own)
