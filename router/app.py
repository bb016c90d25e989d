"""The Ray Serve application: ``serve run deploy/cluster.yaml`` imports ``router.app:build_app``.

Two deployments:

- ``FairwayIngress`` (``router/ingress.py``): the OpenAI-compatible HTTP API; each of its
  replicas holds a handle to the replicas, hence one Fairway request router each;
- ``FairwayReplica`` (``replicas/deployment.py``): engine + admission gate, ``num_replicas`` of
  them, routed by ``router/serve_router.py:FairwayRequestRouter`` (or, with
  ``router.policy: ray-default``, Ray Serve's own power-of-two-choices router, for comparison).

``ClusterArgs`` is the ``args:`` block of the YAML, validated at the boundary: a typo in the
config fails ``serve run`` with the field named, instead of a silent default.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.routing.fairway import router_options_for
from router.tokenizer import resolve_path

RAY_DEFAULT_ROUTER = "ray-default"


class RouterArgs(BaseModel):
    """The request router: a ``router/routing`` policy by name, and how often replicas report."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("fairway", description=f"router policy name, dotted path, or {RAY_DEFAULT_ROUTER!r}")
    policy_options: dict[str, Any] = Field(default_factory=dict)
    stats_period_s: float = Field(1.0, gt=0, description="record_routing_stats period (Ray's default is 10 s)")
    seed: int = 0


class ReplicaOptions(BaseModel):
    """The replica gate: local queue policy and its bound."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "fairway"
    policy_options: dict[str, Any] = Field(default_factory=dict)
    max_queue: int = Field(512, ge=1)
    prefill_budget_tokens: int | None = Field(None, ge=1)


class ClusterArgs(BaseModel):
    """The application's arguments (the YAML's ``args``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("fairway-tiny", description="the model name clients send")
    tokenizer: str = Field("deploy/models/fairway-tiny", description="tokenizer path or hub name")
    max_model_len: int = Field(32768, ge=16)
    block_size: int = Field(16, ge=1)
    profile: str = Field("h200-llama3-8b", description="cost profile (router estimates, sim engine timing)")
    engine: str = Field("sim", description="sim | vllm | module:Class")
    engine_args: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int = Field(2, ge=1)
    ingress_replicas: int = Field(1, ge=1)
    replica: ReplicaOptions = Field(default_factory=ReplicaOptions)
    router: RouterArgs = Field(default_factory=RouterArgs)
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread replicas over nodes")
    replica_num_cpus: float = Field(0.5, ge=0)
    replica_num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(4096, ge=1, description="per replica, Ray level; the gate bounds the queue")
    max_queued_requests: int = Field(-1, description="Ray-level queue at each handle (-1 unbounded) -> 503")
    metrics: bool = True

    def router_policy_options(self) -> dict[str, Any]:
        """The router policy's options: the YAML's, plus (for ``fairway``, where the YAML leaves
        them out) the wait model that matches the replicas' queue policy."""
        return router_options_for(self.router.policy, self.router.policy_options, self.replica.policy,
                                  self.replica.policy_options)

    def replica_args(self) -> dict[str, Any]:
        engine_args = dict(self.engine_args)
        for key in ("model", "tokenizer"):  # repo-relative paths, so replicas find them from any cwd
            if isinstance(engine_args.get(key), str):
                engine_args[key] = resolve_path(engine_args[key])
        engine_args.setdefault("block_size", self.block_size)
        engine_args.setdefault("max_model_len", self.max_model_len)
        if self.engine == "sim":
            engine_args.setdefault("profile", self.profile)
        return {
            "engine": self.engine,
            "engine_args": engine_args,
            "policy": self.replica.policy,
            "policy_options": self.replica.policy_options,
            "max_queue": self.replica.max_queue,
            "prefill_budget_tokens": self.replica.prefill_budget_tokens,
            "profile": self.profile,
            "metrics": self.metrics,
        }


def build_app(args: dict[str, Any]) -> Any:
    """The bound Serve application for ``args`` (``serve run``'s builder hook)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from replicas.deployment import FairwayReplica
    from router.ingress import FairwayIngress, app

    a = ClusterArgs(**(args or {}))
    options: dict[str, Any] = {
        "name": "FairwayReplica",
        "num_replicas": a.num_replicas,
        "max_ongoing_requests": a.max_ongoing_requests,
        "max_queued_requests": a.max_queued_requests,
        "ray_actor_options": {"num_cpus": a.replica_num_cpus, "num_gpus": a.replica_num_gpus},
        "health_check_period_s": 5,
    }
    if a.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = a.max_replicas_per_node
    if a.router.policy != RAY_DEFAULT_ROUTER:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="router.serve_router:FairwayRequestRouter",
            request_router_kwargs={
                "policy": a.router.policy,
                "policy_options": a.router_policy_options(),
                "profile": a.profile,
                "block_size": a.block_size,
                "seed": a.router.seed,
                "metrics": a.metrics,
            },
            request_routing_stats_period_s=a.router.stats_period_s,
        )
    replica = serve.deployment(FairwayReplica, **options)
    ingress = serve.deployment(
        serve.ingress(app)(FairwayIngress),
        name="FairwayIngress",
        num_replicas=a.ingress_replicas,
        max_ongoing_requests=a.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0.25},
    )
    return ingress.bind(replica.bind(a.replica_args()), a.model_dump())
