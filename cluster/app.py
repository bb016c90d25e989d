"""The Ray Serve application: ``serve run deploy/cluster.yaml`` imports ``cluster.app:build_app``.

Two deployments:

- ``FairwayIngress`` (``router/ingress.py``): the OpenAI-compatible HTTP API; each of its
  replicas holds a handle to the replicas, hence one Fairway request router each;
- ``FairwayReplica`` (``replicas/deployment.py``): engine + admission gate, ``num_replicas`` of
  them, routed by ``router/serve_router.py:FairwayRequestRouter`` (or, with
  ``router.policy: ray-default``, Ray Serve's own power-of-two-choices router, for comparison).

``ClusterArgs`` (``cluster/config.py``) is the ``args:`` block of the YAML, parsed once here: a typo
in the config fails ``serve run`` with the field named, instead of a silent default; each
deployment then gets its own typed arguments, not the whole config.
"""

from __future__ import annotations

from typing import Any

from cluster.config import RAY_DEFAULT_ROUTER, ClusterArgs


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
            request_router_kwargs=a.router_kwargs(),
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
    return ingress.bind(replica.bind(a.replica_args()), a.ingress_args())
