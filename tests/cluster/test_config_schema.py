"""``cluster/config.py``: the replica's one schema, and engine options checked when the config is parsed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import ClusterArgs
from fairway.cost_model import DEFAULT_PROFILE
from replicas.deployment import ReplicaArgs, ReplicaOptions
from replicas.engines import EngineError, validated_engine
from replicas.gate import GateConfig


@pytest.mark.parametrize(("engine", "engine_args", "needle"), [
    ("sim", {"max_num_seq": 8}, "max_num_seq"),
    ("sim", {"speed": 0}, "speed must be > 0"),
    ("vllm", {"model": "m", "gpu_memory_utilisation": 0.5}, "gpu_memory_utilisation"),
    ("vllm", {}, "model"),
    ("simm", {}, "unknown engine 'simm'"),
])
def test_a_bad_engine_option_fails_when_the_config_is_parsed(engine, engine_args, needle):
    with pytest.raises(ValidationError, match=needle):
        ClusterArgs(engine=engine, engine_args=engine_args)


def test_validated_engine_names_the_engine_and_accepts_good_options():
    validated_engine("sim", {"max_num_seqs": 8, "kv_blocks": 100})
    with pytest.raises(EngineError, match="bad options for engine 'sim'.*max_num_seq\\b"):
        validated_engine("sim", {"max_num_seq": 8})


def test_the_engine_is_checked_with_the_options_the_replicas_get():
    a = ClusterArgs(engine_args={"max_num_seqs": 8}, block_size=32, max_model_len=4096)
    assert a.replica_engine_args() == {"max_num_seqs": 8, "block_size": 32, "max_model_len": 4096,
                                       "profile": DEFAULT_PROFILE}
    assert a.replica_args().engine_args == a.replica_engine_args()


def test_one_set_of_replica_defaults():
    gate = GateConfig()
    assert ReplicaOptions().gate_config() == gate
    assert ReplicaArgs().gate_config() == gate
    assert ClusterArgs().replica_args().gate_config() == gate
    assert ClusterArgs().replica_args().profile == ReplicaArgs().profile == DEFAULT_PROFILE


def test_every_replica_option_reaches_the_replica():
    options = {"policy": "fcfs", "policy_options": {}, "max_queue": 7, "prefill_budget_tokens": 300,
               "stall_timeout_s": 2.5, "fault_file": "/tmp/f.json", "tenant_fair": False, "tenant_recent_s": 4.0,
               "max_queue_wait_s": None, "oldest_first_after_s": 9.0, "strict_tiers": True}
    assert set(options) == set(ReplicaOptions.model_fields)
    a = ClusterArgs(replica=options, metrics=False, stream_interval_s=0.0,
                    classes=[{"name": "interactive", "tier": 0}, {"name": "batch", "tier": 1}]).replica_args()
    assert {k: getattr(a, k) for k in options} == options
    assert (a.metrics, a.stream_interval_s, a.engine) == (False, 0.0, "sim")
    assert a.gate_config() == GateConfig(max_queue=7, prefill_budget_tokens=300, stall_timeout_s=2.5,
                                         tenant_recent_s=4.0, max_queue_wait_s=None, oldest_first_after_s=9.0)


@pytest.mark.parametrize(("field", "value"), [("max_queue", 0), ("stall_timeout_s", 0), ("max_queue_wait_s", 0),
                                              ("prefill_budget_tokens", 0), ("tenant_recent_s", 0)])
def test_gate_limits_are_checked_in_the_yaml_and_in_the_gate_alike(field, value):
    with pytest.raises(ValidationError, match=field):
        GateConfig(**{field: value})
    with pytest.raises(ValidationError, match=field):
        ClusterArgs(replica={field: value})
