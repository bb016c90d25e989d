"""Build a simulation from a typed run config and summarise it (shared by the CLI, sweeps, tests)."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fairway.admission import AdmissionConfig
from fairway.clock import ManualClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.engine.model import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    EngineConfig,
    EngineModel,
    prefill_chunk,
)
from fairway.policies import make_policy, policy_class
from fairway.policies.classes import ClassesConfig
from fairway.routing import RouterError, router_class
from fairway.routing.fairway import router_options_for
from fairway.summary import pct, served_rate
from sim.cluster import ClusterRouter, ceiling_hit_ratio
from sim.flow import FlowControl, flow_summary
from sim.hit_bounds import References, hit_ratio_bounds
from sim.metrics import summarize
from sim.simulator import Simulation
from sim.ttft_floor import ttft_floor
from workloads.class_mix import ClassMix, parse_mix
from workloads.registry import make_workload_from


class RunConfig(BaseModel):
    """One simulator run. Field bounds are checked at the boundary (CLI, sweep, tests)."""

    model_config = ConfigDict(extra="forbid")

    workload: str
    policy: str
    policy_options: dict[str, Any] = Field(default_factory=dict)
    rate: float = Field(4.0, gt=0, description="requests/s (open loop) or sessions/s (agentic)")
    duration_s: float | None = Field(None, gt=0, description="arrivals stop after this (seconds); default: "
                                     "300 s for a synthetic workload, the whole trace for a replay")
    time_scale: float = Field(1.0, gt=0, description="trace time compression factor")
    concurrency: int | None = Field(None, ge=1, description="fixed-concurrency mode")
    replicas: int = Field(1, ge=1)
    router: str = Field("round-robin", description="router policy (used when replicas > 1)")
    router_options: dict[str, Any] = Field(default_factory=dict)
    routers: int = Field(1, ge=1, description="independent router instances, each sees 1/K")
    index_mode: Literal["approx", "lru", "decisions", "events"] | None = Field(
        None, description="router prefix index; None = the router's own default "
                          "(RouterPolicy.default_index_mode: events for dynamo, else approx)")
    router_view: Literal["own", "shared"] = Field(
        "own", description="own: each router instance sees its own decisions; shared: every instance's")
    sync_delay_s: float = Field(0.0, ge=0, description="shared view: seconds before one instance's news reaches "
                                                       "the others")
    stale_s: float = Field(0.0, ge=0, description="router load-view staleness (seconds)")
    profile: str = DEFAULT_PROFILE
    kv_blocks: int | None = Field(None, ge=1, description="KV capacity in blocks per replica")
    block_size: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0, description="the most prompt tokens one request computes "
                                              "in a step (vLLM's option of that name); 0: the step's budget")
    seed: int = 0
    admission: Literal["off", "session"] = Field("off", description="engine admission gate (fairway.admission)")
    admission_options: dict[str, Any] = Field(default_factory=dict)
    retention: Literal["lru", "peek", "prism", "session"] | None = Field(
        None, description="KV eviction strategy; None = the queue policy's")
    host_kv_blocks: int = Field(0, ge=0, description="host (CPU) KV tier per replica, in blocks; 0 = off")
    classes: str = Field("", description="request classes, name:tier=..:objective=..:weight=..:max_wait=.., "
                                         "comma-separated (fairway.policies.classes); empty: none")
    class_mix: str = Field("", description="name=share,...: each request's class, drawn by a seeded RNG; "
                                           "empty with classes: every request in the default class")
    class_bounds: Literal["class", "gate"] = Field(
        "class", description="with classes: refuse on each class's wait bound over the work ahead of it (class), "
                             "or on today's gate bound over all the queued work (gate)")
    gate_wait_s: float = Field(5.0, gt=0, description="class_bounds=gate: the gate's wait bound (seconds)")
    flow_retry: bool = Field(True, description="with classes: a request over the bound on the router's pick "
                                               "goes to the next replica with room")
    hold: bool = Field(False, description="with classes: the router's held queue (the product's): a replica has "
                                          "room within the gates' bound (gate_wait_s), a request none has room "
                                          "for waits at the router within its wait bound (sim/flow.py)")
    hold_s: float = Field(10.0, gt=0, description="hold with class_bounds=gate: every request's wait bound "
                                                  "(router.hold.max_wait_s)")
    strict_prefill_first: bool = Field(False, description="with classes: a step in which the strictest tier has "
                                                          "prefill runs no lower tier's prefill (EngineConfig)")

    #: options added after run caches were written (``bench.score``, ``bench.yardstick``), each
    #: with the default that reproduces the runs from before it: ``key`` leaves them out at it
    LATE_DEFAULTS: ClassVar[dict[str, Any]] = {"long_prefill_token_threshold": 0}

    def key(self) -> str:
        """The run's identity for result caches: its JSON, less the options added later while at
        their default (so a cached run of the same configuration is still found)."""
        return self.model_dump_json(exclude={k for k, v in self.LATE_DEFAULTS.items() if getattr(self, k) == v})

    @model_validator(mode="after")
    def _resolve_index_mode(self) -> RunConfig:
        """An unset ``index_mode`` becomes the router's own default (``dynamo`` reads the KV-event
        index, as Dynamo does by default); an unknown router keeps "approx" and fails in
        ``build``."""
        if self.index_mode is None:
            try:
                self.index_mode = router_class(self.router).default_index_mode  # type: ignore[assignment]
            except RouterError:
                self.index_mode = "approx"
        return self


def router_options(cfg: RunConfig) -> dict[str, Any]:
    """The router policy's options: the run's, plus (for ``fairway``, where the run leaves them
    out) the wait model that matches the replicas' queue policy and their engines' prefill
    chunk."""
    return router_options_for(cfg.router, cfg.router_options, cfg.policy, cfg.policy_options,
                              prefill_chunk(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold))


def admission_config(cfg: RunConfig) -> AdmissionConfig | None:
    """The engine's admission gate config (None when off); ``ValueError`` on an unknown option."""
    if cfg.admission == "off":
        if cfg.admission_options:
            raise ValueError("admission options given with --admission off")
        return None
    try:
        return AdmissionConfig(**cfg.admission_options)
    except TypeError as e:
        raise ValueError(f"bad admission option: {e}") from None


def classes_of(cfg: RunConfig) -> ClassesConfig:
    """The run's classes (empty: none); ``ValueError`` on a bad spec or a class option given
    without classes."""
    classes = ClassesConfig.parse(cfg.classes)
    if not classes.classes and cfg.class_mix:
        raise ValueError("--class-mix needs --classes")
    return classes


def held_order(cfg: RunConfig) -> str:
    """The queue policy that orders held requests within a class: the replicas' (its inner one
    for ``classes``; FCFS for the flow-control anchors, whose order within a flow is FCFS)."""
    if cfg.policy == "classes":
        return str(cfg.policy_options.get("inner", "fairway"))
    if cfg.policy in ("priority-fcfs", "llmd-flow"):
        return "fcfs"
    return cfg.policy


def build(cfg: RunConfig) -> tuple[Simulation, ManualClock]:
    clock = ManualClock()
    classes = classes_of(cfg)
    flow = None
    policy_options = cfg.policy_options
    cost = CostModel.from_profile(cfg.profile)
    if classes.classes:
        flow = FlowControl(classes, cfg.class_bounds, cfg.gate_wait_s, cfg.flow_retry, hold=cfg.hold,
                           hold_s=cfg.hold_s, clock=clock, cost=cost, inner=held_order(cfg))
        if policy_class(cfg.policy).takes_classes and "classes" not in policy_options:
            policy_options = {**policy_options, "classes": classes}
    elif cfg.hold:
        raise ValueError("--hold needs --classes (use --class-bounds gate to ignore them)")
    if cfg.strict_prefill_first and (not classes.classes or not policy_class(cfg.policy).takes_classes):
        raise ValueError("--strict-prefill-first needs --classes and a policy that orders by class (classes, "
                         "priority-fcfs, llmd-flow): it tells the engine each request's tier")
    engine_cfg = EngineConfig(
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        strict_prefill_first=cfg.strict_prefill_first,
        kv_blocks=cfg.kv_blocks,
        retention=cfg.retention,
        host_kv_blocks=cfg.host_kv_blocks,
        admission=admission_config(cfg),
    )
    replicas = []
    for j in range(cfg.replicas):
        policy = make_policy(
            cfg.policy, clock=clock, cost=cost, block_size=cfg.block_size, **policy_options
        )
        replicas.append(EngineModel(engine_cfg, cost, policy, clock, replica=j))
    workload = make_workload_from(cfg)
    if cfg.class_mix:
        workload = ClassMix(workload, parse_mix(cfg.class_mix, classes), cfg.seed)
    router = None
    if flow is not None and cfg.replicas == 1:
        def router(spec, engines):  # type: ignore[no-untyped-def]  # one replica: the bound only
            return flow.place(spec, engines, [0])
    if cfg.replicas > 1:
        router = ClusterRouter(
            cfg.router,
            cfg.replicas,
            clock,
            cost,
            block_size=cfg.block_size,
            seed=cfg.seed,
            routers=cfg.routers,
            index_mode=cfg.index_mode,
            view=cfg.router_view,
            sync_delay_s=cfg.sync_delay_s,
            capacity_blocks=replicas[0].pool.num_blocks,
            stale_s=cfg.stale_s,
            options=router_options(cfg),
            flow=flow,
            # the router prices a request on its class's queue where the replicas order by class
            classes=classes if flow is not None and policy_class(cfg.policy).takes_classes else None,
        )
    sim = Simulation(workload, replicas, clock, router=router)
    sim.flow = flow
    return sim, clock


def run(cfg: RunConfig, keep_samples: bool = False) -> dict[str, Any]:
    """Run one configuration and return the JSON-ready summary (with every finished request's
    TTFT under ``ttft_samples_s`` if ``keep_samples``)."""
    sim, _ = build(cfg)
    res = sim.run()
    summary = summarize(res.finished)
    first = min((r.spec.arrival_s for r in res.finished), default=0.0)
    last = max((r.spec.arrival_s for r in res.finished), default=0.0)
    n_req = res.n_arrived
    policies = [e.policy for e in sim.replicas]
    out: dict[str, Any] = {
        "workload": cfg.workload,
        "policy": cfg.policy,
        "policy_options": cfg.policy_options,
        "replicas": cfg.replicas,
        "router": cfg.router if cfg.replicas > 1 else None,
        "routers": cfg.routers,
        "router_view": cfg.router_view,
        "sync_delay_s": cfg.sync_delay_s,
        "rate_rps": cfg.rate,
        "realized_rate_rps": (len(res.finished) - 1) / (last - first) if last > first else 0.0,
        "served_rps": served_rate([r.spec.arrival_s for r in res.finished], [r.finished_s for r in res.finished]),
        "concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "profile": cfg.profile,
        "kv_blocks": sim.replicas[0].pool.num_blocks,
        "n_requests": n_req,
        "n_finished": len(res.finished),
        "n_rejected": len(res.rejected),
        "n_unfinished": res.n_unfinished,
        **summary,
        "preemptions": res.preemptions,
        "evictions": res.evictions,
        "promotions": sum(getattr(p, "promotions", 0) for p in policies),
        # decisions Fairway's memory guard changed (0: the run is the one without the guard)
        "guard_acts": sum(getattr(p, "guard_acts", 0) for p in policies),
        # steps a pick sat out for others' first tokens (fairway[first_step_hold=true])
        "first_step_holds": sum(e.first_step_holds for e in sim.replicas),
        "busy_fraction": [b / res.end_s if res.end_s else 0.0 for b in res.busy_s],
        # whether the engines' sequence slots ever bound: a run whose peak is under max_num_seqs
        # is the same at any larger slot count
        "slots": {
            "max_num_seqs": cfg.max_num_seqs,
            "peak_running": max(e.peak_running for e in sim.replicas),
            "bound_step_fraction": (sum(e.slot_bound_steps for e in sim.replicas)
                                    / max(1, sum(e.steps for e in sim.replicas))),
        },
        "sim_end_s": res.end_s,
        "sim_wall_s": res.wall_s,
    }
    retention = sim.replicas[0].retention
    if cfg.admission != "off" or cfg.host_kv_blocks or retention != "lru":
        # only with the KV memory options on, so the default schema stays the one loadgen shares
        reps = sim.replicas
        out["kv_memory"] = {
            "admission": cfg.admission,
            "admission_options": cfg.admission_options,
            "retention": retention,
            "host_kv_blocks": cfg.host_kv_blocks,
            "tokens": {k: sum(getattr(e, f"{k}_tokens") for e in reps) for k in ("gpu_hit", "host_hit", "miss")},
            "prefill_tokens_computed": sum(e.prefill_tokens for e in reps),
            "holds": sum(e.holds for e in reps),
            "hold_releases_due": sum(e.hold_releases_due for e in reps),
            "host_reload_s": sum(e.reload_s for e in reps),
        }
    if cfg.replicas > 1:
        n = [0] * cfg.replicas
        prompt = [0] * cfg.replicas
        cached = [0] * cfg.replicas
        for r in res.finished:  # one pass, not one per replica
            n[r.replica] += 1
            prompt[r.replica] += r.spec.prompt_tokens
            cached[r.replica] += max(0, r.cached_tokens)
        per = []
        for j, e in enumerate(sim.replicas):
            p, c = prompt[j], cached[j]
            per.append({"replica": j, "requests": n[j], "hit_ratio": c / p if p else 0.0,
                        "busy_fraction": e.busy_s / res.end_s if res.end_s else 0.0,
                        "prefill_busy_fraction": e.prefill_busy_s / res.end_s if res.end_s else 0.0})
        out["per_replica"] = per
        specs = [r.spec for r in res.finished]
        capacity = sum(e.pool.num_blocks for e in sim.replicas)
        refs = References.of(specs, cfg.block_size)  # flattened once for the replay and the bounds
        out["ceiling_hit_ratio"] = ceiling_hit_ratio(specs, capacity, cfg.block_size, refs)  # LRU replay
        out["hit_bound_capacity"], out["hit_bound_infinite"] = hit_ratio_bounds(specs, capacity, cfg.block_size,
                                                                                refs)
        # the least TTFT any router and queue order could give these requests (sim/ttft_floor.py)
        out["ttft_floor_s"] = pct(ttft_floor(specs, sim.replicas[0].cost, cfg.block_size,
                                             cfg.max_num_batched_tokens, refs))
        out["routing_reasons"] = sim.router.reasons() if hasattr(sim.router, "reasons") else {}
        if hasattr(sim.router, "model_ratios"):  # the router's expected TTFT against the run's
            out["router_ttft_model"] = sim.router.model_ratios({r.spec.rid: r.ttft_s for r in res.finished})
    if cfg.classes:  # only with classes, so the default schema stays the one loadgen shares
        out["flow"] = flow_summary(res.finished, res.rejected, classes_of(cfg), sim.flow)
    if keep_samples:
        out["ttft_samples_s"] = [r.ttft_s for r in res.finished]
    return out


def dump(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=False)
