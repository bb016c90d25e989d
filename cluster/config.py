"""The application's configuration: the ``args:`` block of ``deploy/*.yaml``, parsed once.

``serve run`` calls ``cluster.app:build_app(args)``, which parses ``ClusterArgs`` here before
anything is deployed, so a typo fails ``serve run`` with the field named: unknown keys are errors,
every policy spec is resolved and checked by building the policy once, and the engine options by
building the engine once, unstarted (an unknown policy or engine or a misspelled option fails here,
not later in a replica). From the parsed config, ``ingress_args``,
``replica_args`` and ``router_kwargs`` give each deployment its own typed arguments.

A policy is named the same way everywhere: ``policy: fairway`` with ``policy_options: {theta: 4}``,
or ``policy: "fairway[theta=4]"`` (``fairway/spec.py``); after parsing, ``policy`` is the bare name
and ``policy_options`` holds every option.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from fairway.engine.model import prefill_chunk
from fairway.policies import validated_policy
from fairway.policies.classes import ClassesConfig, ClassSpec
from fairway.routing import validated_router
from fairway.routing.fairway import router_options_for
from fairway.routing.view_log import DEFAULT_KV_PERIOD_S, DEFAULT_SYNC_PERIOD_S
from fairway.spec import resolve_spec
from replicas.deployment import ReplicaArgs, ReplicaOptions, ServedEngine
from replicas.engines import validated_engine
from router.auth import AuthArgs, KeyTable
from router.cors import CorsArgs
from router.hold import HoldArgs
from router.ingress import IngressArgs, ServedModel
from router.limits import RequestLimits
from router.tokenizer import resolve_path

RAY_DEFAULT_ROUTER = "ray-default"


class RouterArgs(BaseModel):
    """The request router: a ``fairway.routing`` policy, and how often replicas report."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("fairway", description=f"router policy spec, dotted path, or {RAY_DEFAULT_ROUTER!r}")
    policy_options: dict[str, Any] = Field(default_factory=dict)
    stats_period_s: float = Field(1.0, gt=0, description="record_routing_stats period (Ray's default is 10 s)")
    seed: int = 0
    shared_view: bool | None = Field(
        None, description="the request routers of all ingress replicas share one routing view (a Ray actor); "
                          "default: on when ingress_replicas > 1")
    sync_period_s: float | None = Field(
        None, gt=0, le=1.0, description="how often each router exchanges with the shared view; default: "
                                        f"{DEFAULT_SYNC_PERIOD_S} s with > 1 ingress replica (the routers share their "
                                        "routings), else kv_period_s (one router only reads the KV events)")
    kv_period_s: float = Field(DEFAULT_KV_PERIOD_S, gt=0, le=1.0,
                               description="exact prefix view: how often each replica sends its engine's KV events "
                                           "to the shared view")
    prefix_view: Literal["approx", "events"] | None = Field(
        None, description="events: the replicas' exact KV events through the shared view (which it turns on), the "
                          "approximate index as the fallback while they are not current; approx: the index learns "
                          "from routings and cached-token reports only; default: events with Fairway's request "
                          "router and its shared view, else approx")
    hold: HoldArgs = Field(default_factory=HoldArgs, description="the held queue: a request every replica's queue "
                           "refused waits at the router for room within its wait bound (router/hold.py)")


class ClusterArgs(ServedModel, ServedEngine):
    """The application's arguments (the YAML's ``args``): the served model's keys, the engine's
    (``replicas/deployment.py:ServedEngine``), then these."""

    num_replicas: int = Field(2, ge=1)
    ingress_replicas: int = Field(1, ge=1)
    # the engines' prefill chunk, read from the engine the validator builds (None: not yet)
    _prefill_chunk: int | None = PrivateAttr(None)
    replica: ReplicaOptions = Field(default_factory=ReplicaOptions)
    router: RouterArgs = Field(default_factory=RouterArgs)
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread replicas over nodes")
    replica_num_cpus: float = Field(0.5, ge=0)
    replica_num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(4096, ge=1, description="per replica, Ray level; the gate bounds the queue")
    max_queued_requests: int = Field(-1, description="Ray-level queue at each handle (-1 unbounded) -> 503")
    limits: RequestLimits = Field(default_factory=RequestLimits)
    cors: CorsArgs = Field(default_factory=CorsArgs, description="browsers' cross-origin access (router/cors.py)")
    auth: AuthArgs = Field(default_factory=AuthArgs)
    classes: list[ClassSpec] = Field(default_factory=list, description="request classes (docs/design.md, Flow "
                                     "control): name, tier (strict, lower first), weight, objective_s, max_wait_s")
    default_class: str = Field("", description="the class of a request that names none (default: the last)")
    stream_channel: bool = Field(True, description="each ingress replica opens one stream channel per replica, "
                                 "which carries the middle chunks of all its streams there, merged per flush "
                                 "(replicas/channel.py); with router.policy ray-default, off (it is pinned by "
                                 "Fairway's request router)")

    @model_validator(mode="after")
    def _resolve_policies(self) -> ClusterArgs:
        """Resolve both policy specs to (name, options) and check them by building each once;
        read the API keys once (a missing file or variable fails here)."""
        if self.auth.keys_file:
            self.auth.keys_file = resolve_path(self.auth.keys_file)
        KeyTable(self.auth)
        classes = self.request_classes()
        for name, tenant in self.auth.tenants.items():
            for field, names in (("default_class", [tenant.default_class] if tenant.default_class else []),
                                 ("classes", tenant.classes)):
                for class_name in names:
                    try:
                        classes.resolve(class_name)
                    except ValueError as e:
                        raise ValueError(f"auth.tenants.{name}.{field}: {e}") from None
            default = classes.resolve(tenant.default_class)
            if tenant.classes and default not in tenant.classes:
                raise ValueError(f"auth.tenants.{name}: its default class {default!r} is not among its classes "
                                 f"{tenant.classes}: set default_class to one of them")
        if "tiers" in self.engine_args:
            raise ValueError("engine_args.tiers is set by the replica: use replica.strict_tiers")
        if self.replica.strict_tiers and not classes.classes:
            raise ValueError("replica.strict_tiers needs request classes (classes:): the engine orders by their tiers")
        if self.replica.strict_tiers is None:  # what tiers mean: a stricter tier's prefill goes first
            self.replica.strict_tiers = len({c.tier for c in classes.classes}) > 1
        if classes.classes and self.replica.policy == "classes":
            raise ValueError("the request classes are configured once, at the top level (classes:); "
                             "replica.policy names the order within a class")
        # the exact view wherever its KV events can reach a router (docs/design.md, Fairway router)
        no_events = self.router.shared_view is False or self.router.policy == RAY_DEFAULT_ROUTER
        if self.router.prefix_view is None:
            self.router.prefix_view = "approx" if no_events else "events"
        if self.router.prefix_view == "events" and no_events:
            raise ValueError("router.prefix_view: events needs Fairway's request router with its shared view "
                             "(the replicas' KV events travel through it)")
        if self.router.sync_period_s is None:  # an exchange is an actor call: only as often as it has news
            self.router.sync_period_s = DEFAULT_SYNC_PERIOD_S if self.ingress_replicas > 1 else self.router.kv_period_s
        r = self.replica
        r.policy, r.policy_options = validated_policy(r.policy, r.policy_options, block_size=self.block_size,
                                                      profile=self.profile)
        engine = validated_engine(self.engine, self.replica_args().engine_options())  # as each replica builds it
        # the router prices a long prompt in the engines' own chunks (FairwayRouterConfig.prefill_chunk)
        self._prefill_chunk = prefill_chunk(engine.max_num_batched_tokens,
                                            getattr(engine, "long_prefill_token_threshold", 0))
        if self.router.policy != RAY_DEFAULT_ROUTER:  # checked once, with the options it will run with
            t = self.router
            t.policy, t.policy_options = resolve_spec(t.policy, t.policy_options)
            validated_router(t.policy, self.router_policy_options(), block_size=self.block_size,
                             profile=self.profile)
        return self

    def request_classes(self) -> ClassesConfig:
        """The configured request classes (``ValueError`` for duplicates or an unknown default)."""
        return ClassesConfig(tuple(self.classes), self.default_class)

    def router_policy_options(self) -> dict[str, Any]:
        """The router policy's options: the YAML's, plus (for ``fairway``, where the YAML leaves
        them out) the wait model that matches the replicas' queue policy."""
        return router_options_for(self.router.policy, self.router.policy_options, self.replica.policy,
                                  self.replica.policy_options, self._prefill_chunk)

    def ingress_args(self) -> IngressArgs:
        served = self.model_dump(include=set(ServedModel.model_fields))
        return IngressArgs(**served, router_policy=self.router.policy, metrics=self.metrics, limits=self.limits,
                           auth=self.auth, cors=self.cors, classes=self.request_classes(), hold=self.router.hold,
                           hold_policy=self.replica.policy, hold_policy_options=self.replica.policy_options,
                           profile=self.profile, gate_wait_s=self.replica.max_queue_wait_s,
                           stream_channel=self.stream_channel and self.router.policy != RAY_DEFAULT_ROUTER)

    def replica_engine_args(self) -> dict[str, Any]:
        """The engine options every replica builds its engine with: the YAML's ``engine_args``,
        plus the served model's block size and context length (and, for ``sim``, the profile)."""
        engine_args = dict(self.engine_args)
        for key in ("model", "tokenizer"):  # repo-relative paths, so replicas find them from any cwd
            if isinstance(engine_args.get(key), str):
                engine_args[key] = resolve_path(engine_args[key])
        engine_args.setdefault("block_size", self.block_size)
        engine_args.setdefault("max_model_len", self.max_model_len)
        if self.engine == "sim":
            engine_args.setdefault("profile", self.profile)
        return engine_args

    def replica_args(self) -> ReplicaArgs:
        """Each replica's arguments: the ``replica:`` block, the engine's keys (its options as
        ``replica_engine_args``), and KV-event publishing for the exact prefix view."""
        return ReplicaArgs(
            **self.replica.model_dump(),
            **self.model_dump(include=set(ServedEngine.model_fields) - {"engine_args"}),
            engine_args=self.replica_engine_args(),
            publish_kv_events=self.router.prefix_view == "events",
            kv_publish_period_s=self.router.kv_period_s,
            classes=self.request_classes(),
        )

    def router_kwargs(self) -> dict[str, Any]:
        """``request_router_kwargs`` for ``router/serve_router.py:FairwayRequestRouter``."""
        return {
            "policy": self.router.policy,
            "policy_options": self.router_policy_options(),
            "profile": self.profile,
            "block_size": self.block_size,
            "seed": self.router.seed,
            "metrics": self.metrics,
            "shared_view": self.shared_view(),
            "sync_period_s": self.router.sync_period_s,
            "prefix_view": self.router.prefix_view,
            # JSON, as Ray Serve wants the router's kwargs: the classes the replicas order by
            "classes": [dataclasses.asdict(c) for c in self.classes],
            "default_class": self.default_class,
        }

    def shared_view(self) -> bool:
        """Whether the request routers share one view: as configured, else with > 1 ingress replica
        or the exact prefix view (its events travel through the shared view)."""
        v = self.router.shared_view
        return (self.ingress_replicas > 1 or self.router.prefix_view == "events") if v is None else v
