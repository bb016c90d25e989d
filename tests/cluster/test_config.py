"""Every shipped deployment config parses as Ray Serve's schema and as Fairway's ClusterArgs
(extra keys are errors, so a typo in a YAML fails here, not at ``serve run``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterArgs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def serve_configs() -> list[tuple[str, dict]]:
    out = []
    for name in ("cluster.yaml", "cluster-vllm-cpu.yaml", "cluster-gpu.yaml"):
        out.append((name, yaml.safe_load((DEPLOY / name).read_text())))
    kuberay = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert kuberay["kind"] == "RayService"
    out.append(("kuberay-rayservice.yaml", yaml.safe_load(kuberay["spec"]["serveConfigV2"])))
    return out


@pytest.mark.parametrize(("name", "cfg"), serve_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_config_is_valid(name, cfg):
    ServeDeploySchema(**cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    args = ClusterArgs(**app["args"])
    assert args.engine in ("sim", "vllm")


def test_default_cluster_is_the_sim_engine_with_fairway():
    cfg = dict(serve_configs())["cluster.yaml"]
    args = ClusterArgs(**cfg["applications"][0]["args"])
    assert (args.engine, args.router.policy, args.replica.policy, args.num_replicas) == ("sim", "fairway", "fairway", 2)


def test_unknown_key_is_rejected():
    with pytest.raises(ValidationError, match="replicaz"):
        ClusterArgs(replicaz=3)


def test_fairway_router_gets_the_wait_model_of_the_replica_policy():
    # Fairway replicas (the default): the queue wait model with their Fast-lane share
    assert ClusterArgs().router_policy_options() == {"wait_model": "queue", "fast_share": pytest.approx(0.4),
                                                     "prefill_chunk": 8192}
    args = ClusterArgs(replica={"policy": "fairway", "policy_options": {"fair_share": 0.5}})
    assert args.router_policy_options()["fast_share"] == pytest.approx(0.5)
    # FCFS replicas: W = Q; an operator's explicit choice wins; other routers get theirs as given
    assert ClusterArgs(replica={"policy": "fcfs"}).router_policy_options() == {"wait_model": "fcfs",
                                                                               "prefill_chunk": 8192}
    mine = ClusterArgs(router={"policy": "fairway", "policy_options": {"wait_model": "fcfs", "theta": 8}})
    assert mine.router_policy_options() == {"wait_model": "fcfs", "fast_share": pytest.approx(0.4), "theta": 8,
                                            "prefill_chunk": 8192}
    assert ClusterArgs(router={"policy": "pow2"}).router_policy_options() == {}


def test_fairway_router_prices_prompts_in_the_engines_chunks():
    """The router's prefill chunk is read from the engine the config builds: its step budget, or
    its per-request cap where lower; an operator's own value wins."""
    def chunk(**kw: object) -> object:
        return ClusterArgs(**kw).router_policy_options()["prefill_chunk"]

    assert chunk(engine_args={"max_num_batched_tokens": 2048}) == 2048
    assert chunk(engine_args={"max_num_batched_tokens": 4096, "long_prefill_token_threshold": 512}) == 512
    assert chunk(router={"policy": "fairway", "policy_options": {"prefill_chunk": 0}}) == 0
    with pytest.raises(ValidationError, match="prefill_chunk"):
        ClusterArgs(router={"policy": "fairway", "policy_options": {"prefill_chunk": -1}})


def test_policy_specs_resolve_the_same_in_yaml_as_on_the_command_line():
    a = ClusterArgs(replica={"policy": "fairway[theta=4]"}, router={"policy": "fairway[theta=8]"})
    assert (a.replica.policy, a.replica.policy_options) == ("fairway", {"theta": 4})
    assert (a.router.policy, a.router.policy_options) == ("fairway", {"theta": 8})
    assert a.replica_args().policy_options == {"theta": 4}
    assert a.router_kwargs()["policy_options"]["theta"] == 8
    turns = ClusterArgs(replica={"policy": "fairway[lost_blocks=65536;lost_scope=turns]"})
    assert turns.replica_args().policy_options == {"lost_blocks": 65536, "lost_scope": "turns"}


@pytest.mark.parametrize(("args", "needle"), [
    ({"replica": {"policy": "fairway", "policy_options": {"thetta": 4}}}, "thetta"),
    ({"replica": {"policy": "fairway[theta=4]", "policy_options": {"theta": 6}}}, "given twice"),
    ({"replica": {"policy": "nope"}}, "unknown policy 'nope'"),
    ({"router": {"policy": "fairway", "policy_options": {"wait_modle": "fcfs"}}}, "wait_modle"),
    ({"router": {"policy": "pow3"}}, "unknown router 'pow3'"),
    ({"replica": {"policy": "fairway[lost_blocks=65536;lost_scope=shared]"}}, "lost_scope"),
])
def test_bad_policy_options_fail_when_the_config_is_parsed(args, needle):
    with pytest.raises(ValidationError, match=needle):
        ClusterArgs(**args)


def test_ray_default_router_is_not_a_policy_spec():
    assert ClusterArgs(router={"policy": "ray-default"}).router.policy == "ray-default"


def test_the_exact_prefix_view_turns_on_the_shared_view_and_the_replicas_publishing():
    a = ClusterArgs(router={"prefix_view": "events"})
    assert a.router_kwargs()["prefix_view"] == "events" and a.router_kwargs()["shared_view"] is True
    assert a.replica_args().publish_kv_events and a.replica_args().kv_publish_period_s == a.router.kv_period_s == 0.05
    assert ClusterArgs(router={"kv_period_s": 0.2}).replica_args().kv_publish_period_s == 0.2
    approx = ClusterArgs(router={"prefix_view": "approx"})
    assert not approx.replica_args().publish_kv_events and approx.router_kwargs()["shared_view"] is False
    for bad in ({"prefix_view": "events", "shared_view": False}, {"prefix_view": "events", "policy": "ray-default"}):
        with pytest.raises(ValidationError, match="prefix_view: events needs"):
            ClusterArgs(router=bad)


def test_the_exact_prefix_view_is_the_default_wherever_it_can_run():
    a = ClusterArgs()
    assert a.router.prefix_view == "events" and a.replica_args().publish_kv_events and a.shared_view()
    # Ray's own router reads no index, and without the shared view no KV event reaches a router
    for router in ({"policy": "ray-default"}, {"shared_view": False}):
        b = ClusterArgs(router=router)
        assert b.router.prefix_view == "approx" and not b.replica_args().publish_kv_events
    # the resolved view survives the trip to Ray's replicas (a pydantic round trip)
    assert ClusterArgs(**a.model_dump()).router.prefix_view == "events"


def test_one_router_exchanges_at_the_kv_events_period_and_several_at_the_sync_period():
    one, two = ClusterArgs(), ClusterArgs(ingress_replicas=2)
    assert one.router_kwargs()["sync_period_s"] == one.router.kv_period_s == 0.05  # it only reads KV events
    assert two.router_kwargs()["sync_period_s"] == 0.01  # the routers share their routings
    assert ClusterArgs(router={"sync_period_s": 0.02}).router_kwargs()["sync_period_s"] == 0.02
    assert ClusterArgs(**two.model_dump()).router.sync_period_s == 0.01


def test_the_replicas_age_bound_reaches_the_gate_config():
    assert ClusterArgs().replica_args().oldest_first_after_s is None  # off by default
    assert ClusterArgs(replica={"oldest_first_after_s": 10}).replica_args().oldest_first_after_s == 10
    with pytest.raises(ValueError, match="oldest_first_after_s"):
        ClusterArgs(replica={"oldest_first_after_s": 0})


CLASSES = [{"name": "interactive", "tier": 0, "objective_s": 1.0}, {"name": "batch", "tier": 1, "objective_s": 30.0}]


def test_request_classes_reach_the_ingress_and_every_replica():
    args = ClusterArgs(classes=CLASSES, default_class="interactive",
                       auth={"tenants": {"evals": {"default_class": "batch"}}})
    cfg = args.request_classes()
    assert cfg.names == ("interactive", "batch") and cfg.default_name == "interactive"
    assert args.ingress_args().classes == cfg and args.replica_args().classes == cfg
    # the replica's arguments travel to Ray as a dict and come back whole
    assert type(args.replica_args())(**args.replica_args().model_dump()).classes == cfg


@pytest.mark.parametrize(("extra", "needle"), [
    ({"classes": CLASSES + [{"name": "batch", "tier": 2}]}, "duplicate class names"),
    ({"classes": CLASSES, "default_class": "gold"}, "default class 'gold' is not one of"),
    ({"classes": [{"name": "x", "tier": -1}]}, "tier must be >= 0"),
    ({"classes": [{"name": "x", "objective_s": 0}]}, "objective must be > 0"),
    ({"classes": [{"name": "x", "prio": 1}]}, "prio"),
    ({"classes": CLASSES, "auth": {"tenants": {"evals": {"default_class": "gold"}}}},
     "auth.tenants.evals.default_class: unknown class 'gold'; valid: interactive, batch"),
    ({"classes": CLASSES, "replica": {"policy": "classes"}}, "configured once, at the top level"),
    ({"classes": CLASSES, "auth": {"tenants": {"evals": {"classes": ["batch", "gold"]}}}},
     "auth.tenants.evals.classes: unknown class 'gold'; valid: interactive, batch"),
    ({"classes": CLASSES, "default_class": "interactive", "auth": {"tenants": {"evals": {"classes": ["batch"]}}}},
     "auth.tenants.evals: its default class 'interactive' is not among its classes"),
    ({"classes": CLASSES, "auth": {"tenants": {"evals": {"default_class": "interactive", "classes": ["batch"]}}}},
     "auth.tenants.evals: its default class 'interactive' is not among its classes"),
])
def test_bad_request_classes_fail_when_the_config_is_parsed(extra, needle):
    with pytest.raises(ValidationError, match=needle):
        ClusterArgs(**extra)


def test_a_tenant_limited_to_its_classes_parses_with_a_default_among_them():
    args = ClusterArgs(classes=CLASSES, auth={"tenants": {"evals": {"classes": ["batch"]}}})  # the default: batch
    assert args.auth.tenants["evals"].classes == ["batch"]
    ClusterArgs(classes=CLASSES, default_class="interactive",
                auth={"tenants": {"evals": {"default_class": "batch", "classes": ["batch"]}}})


def test_strict_tiers_need_classes_and_reach_the_replicas_on_either_engine():
    classes = [{"name": "interactive", "tier": 0, "objective_s": 1.0}, {"name": "batch", "tier": 1}]
    with pytest.raises(ValueError, match="strict_tiers needs request classes"):
        ClusterArgs(replica={"strict_tiers": True})
    vllm = {"model": "deploy/models/fairway-tiny-llama"}
    va = ClusterArgs(replica={"strict_tiers": True}, classes=classes, engine="vllm", engine_args=vllm).replica_args()
    assert va.strict_tiers and va.engine == "vllm"
    # the replica sets vLLM's scheduling policy and scheduler class itself: a second setting is refused
    for name, value in (("scheduling_policy", "fcfs"), ("scheduler_cls", "my.Scheduler")):
        with pytest.raises(ValueError, match=f"vLLM's {name} is set by the replica with strict tiers"):
            ClusterArgs(replica={"strict_tiers": True}, classes=classes, engine="vllm",
                        engine_args={**vllm, "engine_args": {name: value}})
        ClusterArgs(classes=classes, engine="vllm", engine_args={**vllm, "engine_args": {name: value}},
                    replica={"strict_tiers": False})  # without strict tiers: vLLM's own setting
    with pytest.raises(ValueError, match="replica.strict_tiers"):
        ClusterArgs(classes=classes, engine_args={"tiers": "x"})
    ra = ClusterArgs(replica={"strict_tiers": True}, classes=classes).replica_args()
    assert ra.strict_tiers and [c.name for c in ra.classes.classes] == ["interactive", "batch"]


@pytest.mark.parametrize("classes, strict, want", [
    (None, None, False),  # no classes: nothing to order by
    ([{"name": "interactive", "tier": 0}, {"name": "batch", "tier": 1}], None, True),  # two tiers: on
    ([{"name": "a", "tier": 0}, {"name": "b", "tier": 0, "weight": 3}], None, False),  # one tier: weights only
    ([{"name": "interactive", "tier": 0}, {"name": "batch", "tier": 1}], False, False),  # turned off
])
def test_strict_tiers_default_on_when_the_classes_span_two_tiers(classes, strict, want):
    args = ClusterArgs(**({"classes": classes} if classes else {}),
                       **({"replica": {"strict_tiers": strict}} if strict is not None else {}))
    assert args.replica.strict_tiers is want and args.replica_args().strict_tiers is want
