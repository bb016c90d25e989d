"""The replica deployment: one engine behind one admission gate, as a Ray Serve replica.

The class is plain Python (``cluster/app.py`` wraps it with ``serve.deployment``), so tests can
drive it without Ray. Methods Ray Serve calls:

- ``generate(call)``: an async generator of ``TokenChunk``s (the ingress calls it through a
  streaming handle); errors the client must see as HTTP statuses are ``ReplicaError``s;
- ``channel(call)``: an ingress replica's stream channel (``replicas/channel.py``), which carries
  the middle chunks of that ingress's streams here;
- ``record_routing_stats()``: the ``ReplicaRoutingStats`` the request routers read (Ray polls it
  every ``request_routing_stats_period_s``);
- ``check_health()``: raises if the engine died, so Ray replaces the replica.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fairway.clock import MonotonicClock
from fairway.cost_model import DEFAULT_PROFILE, CostModel
from fairway.policies import make_policy
from fairway.policies.classes import ClassesConfig
from fairway.protocol import ChannelCall, ChannelPiece, GenerateCall, ReplicaRoutingStats, TokenChunk
from fairway.routing.view_log import DEFAULT_KV_PERIOD_S
from fairway.spec import resolve_spec
from replicas.channel import Channels
from replicas.engines import make_engine
from replicas.gate import AdmissionGate, GateConfig
from replicas.stream import DEFAULT_STREAM_INTERVAL_S, coalesce

logger = logging.getLogger("ray.serve")


class ReplicaOptions(GateConfig):
    """The replica's queue policy and gate (the YAML's ``replica:`` block): ``GateConfig``'s limits
    plus these."""

    policy: str = Field("fairway", description="queue policy spec (fairway.policies) or dotted path")
    policy_options: dict[str, Any] = Field(default_factory=dict)
    fault_file: str | None = Field(None, description="test hook (replicas/faults.py); never in production")
    tenant_fair: bool = Field(True, description="with API keys: one queue per tenant, fair queueing across them")
    strict_tiers: bool | None = Field(None, description="with request classes: the engine (sim, or vLLM with "
                                      "its strict-tier scheduler) serves its waiting requests by tier and runs no "
                                      "lower tier's prefill while the strictest tier has prefill, and the gate "
                                      "admits a request past the lower tiers' backlog. Unset: on when the classes "
                                      "span two tiers or more")

    @model_validator(mode="after")
    def _resolve_policy(self) -> ReplicaOptions:
        """``policy`` may be a spec (``fairway[theta=4]``): resolve it. Its options are checked where
        the config is parsed (``cluster/config.py``) and when ``FairwayReplica`` builds the policy."""
        self.policy, self.policy_options = resolve_spec(self.policy, self.policy_options)
        return self

    def gate_config(self) -> GateConfig:
        """The gate's part of these options."""
        return GateConfig(**self.model_dump(include=set(GateConfig.model_fields)))


class ServedEngine(BaseModel):
    """The engine every replica runs and the settings the replicas share with the rest of the
    application (the YAML's top-level keys: ``ClusterArgs`` has these too)."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(DEFAULT_PROFILE, description="cost profile (router estimates, the policy's prefill "
                                                      "estimates, sim engine timing)")
    engine: str = Field("sim", description="engine kind: sim | vllm | module:Class")
    engine_args: dict[str, Any] = Field(default_factory=dict)
    stream_interval_s: float = Field(DEFAULT_STREAM_INTERVAL_S, ge=0, le=1.0,
                                     description="replicas merge a stream's tokens over this interval; the "
                                                 "first token leaves at once (0: one item per engine step)")
    metrics: bool = Field(True, description="serve /metrics (ingress, routers and replicas)")


class ReplicaArgs(ReplicaOptions, ServedEngine):
    """A replica's configuration (``ClusterArgs.replica_args`` builds it from the app args): its
    options, the engine, and whether it publishes KV events to the routers' shared view."""

    publish_kv_events: bool = Field(False, description="send the engine's KV events to the routers' shared "
                                                       "view (router.prefix_view: events)")
    kv_publish_period_s: float = Field(DEFAULT_KV_PERIOD_S, gt=0, le=1.0, description="how often KV events "
                                                                                          "are sent")
    classes: ClassesConfig = Field(default_factory=ClassesConfig, description="request classes: the gate orders "
                                   "its queue by them (strict tiers, fair shares of prefill work)")

    def engine_options(self) -> dict[str, Any]:
        """The engine's keyword arguments: ``engine_args``, and with strict tiers the request
        classes as ``tiers`` (the engine orders by them)."""
        return {**self.engine_args, **({"tiers": self.classes} if self.strict_tiers else {})}


def replica_name() -> str:
    """This replica's id in Ray Serve, or "replica" outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica
        return "replica"


def _tee(*listeners: Any) -> Any:
    """One cache listener that calls every ``listeners`` with the same hashes."""
    def call(hashes: Any) -> None:
        hs = hashes if isinstance(hashes, list) else list(hashes)
        for f in listeners:
            f(hs)
    return call


class FairwayReplica:
    """Engine + gate (see the module docstring)."""

    async def __init__(self, args: dict[str, Any] | ReplicaArgs) -> None:
        a = args if isinstance(args, ReplicaArgs) else ReplicaArgs(**args)
        self.args = a
        self.name = replica_name()
        self.engine = make_engine(a.engine, **a.engine_options())
        self.engine.stream_interval_s = a.stream_interval_s
        # a stream's tokens are merged once: by an engine that coalesces, else by the replica
        self._coalesce_s = 0.0 if self.engine.coalesces else a.stream_interval_s
        self.clock = clock = MonotonicClock()
        self.channels = Channels(clock)
        block_size = self.engine.block_size
        cost = CostModel.from_profile(a.profile)

        def new_policy() -> Any:  # one per tenant (replicas/tenants.py); by class within it, with classes
            if a.classes.classes:
                return make_policy("classes", clock=clock, cost=cost, block_size=block_size, classes=a.classes,
                                   inner=a.policy, inner_options=a.policy_options)
            return make_policy(a.policy, clock=clock, cost=cost, block_size=block_size, **a.policy_options)

        policy = new_policy()
        self.stats = None
        self.exporter = None
        if a.metrics:
            from observability.exporter import MetricsExporter
            from observability.stats import FairwayStats

            self.stats = FairwayStats(level="replica", component=self.name, policy=a.policy)
            try:
                self.exporter = MetricsExporter([self.stats], component=self.name, level="replica")
                self.exporter.start()
            except Exception as e:  # noqa: BLE001 - serving must not depend on metrics
                logger.warning("replica %s: metrics endpoint not started: %s", self.name, e)
                self.exporter = None
        self.gate = AdmissionGate(self.engine, policy, clock, a.gate_config(), replica=self.name, stats=self.stats,
                                  wait_bound_s=partial(a.classes.wait_bound_for, default=None),  # without classes: none
                                  policy_factory=new_policy if a.tenant_fair else None,
                                  tier_of=(lambda k: a.classes.spec(k).tier) if a.strict_tiers else None)
        await self.gate.start()
        self.kv_publisher = self._publish_kv() if a.publish_kv_events else None
        self.faults = None
        if a.fault_file:
            from replicas.faults import FaultFile

            self.faults = FaultFile(a.fault_file, self.name, self.engine)
            self.faults.start()
        logger.info("replica %s: engine %s, policy %s, max_queue %d", self.name, a.engine, a.policy, a.max_queue)

    def _publish_kv(self) -> Any:
        """Tee the engine's stored / removed events to a ``KvPublisher`` (the policy keeps its own
        listener) that sends them to the application's hub actor, found by name; until a router
        has created the hub, publishing fails quietly and retries. An engine with a host KV tier
        also reports its tier events (``set_tier_listener``) and host-only set
        (``host_only_hashes``): the publisher carries them alone (the policy does not read them)."""
        from ray import serve

        from fairway.routing.view_log import HUB_NAMESPACE, REPLICA_SOURCE, hub_name
        from replicas.kv_publisher import HubNotReady, KvPublisher, ReplicaEvent

        name, source = hub_name(serve.get_replica_context().app_name), REPLICA_SOURCE + self.name
        hub: list[Any] = []

        async def send(events: list[ReplicaEvent]) -> bool:
            import ray

            if not hub:
                try:
                    hub.append(ray.get_actor(name, namespace=HUB_NAMESPACE))
                except ValueError as e:  # no router has created it yet
                    raise HubNotReady(name) from e
            try:
                return await hub[0].publish.remote(source, events)
            except Exception:
                hub.clear()  # find it again: it may have restarted
                raise

        pub = KvPublisher(self.name, send, self.engine.cached_hashes, period_s=self.args.kv_publish_period_s,
                          host_only=self.engine.host_only_hashes)
        policy = self.gate.policy
        self.engine.set_cache_listener(_tee(policy.on_blocks_stored, pub.on_stored),
                                       _tee(policy.on_blocks_removed, pub.on_removed))
        self.engine.set_tier_listener(pub.on_tier)  # engines with a host KV tier: which hashes are host-only
        pub.start()
        return pub

    async def generate(self, call: GenerateCall) -> AsyncIterator[TokenChunk]:
        async for chunk in self.channels.relay(call, coalesce(self.gate.submit(call), self._coalesce_s, self.clock)):
            yield chunk

    async def channel(self, call: ChannelCall) -> AsyncIterator[list[ChannelPiece]]:
        """``call.ingress``'s stream channel; ends at once when ``call`` was meant for another
        replica (the request router pins it, unless a router that does not know channels sent it)."""
        if call.replica != self.name:
            return
        async for batch in self.channels.serve(call.ingress):
            yield batch

    def record_routing_stats(self) -> ReplicaRoutingStats:
        return self.gate.routing_stats()

    async def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError(f"replica {self.name}: engine is not running")
        if self.gate.stalled:
            raise RuntimeError(f"replica {self.name}: engine stalled")

    async def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "replica": self.name,
            "engine": self.args.engine,
            "policy": self.args.policy,
            "block_size": e.block_size,
            "max_model_len": e.max_model_len,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "max_num_seqs": e.max_num_seqs,
            "timing": e.timing(),  # the sim engine's real-time pacing; None for the others
        }

    def __del__(self) -> None:
        if self.__dict__.get("exporter") is not None:
            self.exporter.stop()
