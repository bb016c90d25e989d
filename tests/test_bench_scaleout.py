"""The scale-out benchmark's run plan: a point names a trace at a time scale or a workload at a rate."""

from __future__ import annotations

from bench.scaleout import config


def test_a_trace_point_replays_the_whole_trace_at_its_time_scale():
    c = config("mooncake@3", routers=4, view="shared", delay=0.02, seed=0)
    assert c.workload.startswith("trace:") and c.workload.endswith("mooncake_synthetic_trace.jsonl")
    assert (c.time_scale, c.duration_s, c.routers, c.router_view, c.sync_delay_s) == (3.0, None, 4, "shared", 0.02)
    assert (c.replicas, c.router, c.policy) == (8, "fairway", "fairway")


def test_a_synthetic_point_runs_at_its_rate_and_own_views_have_no_delay():
    c = config("rag-spike@100", routers=4, view="own", delay=0.02, seed=1)
    assert (c.workload, c.rate, c.time_scale, c.duration_s, c.sync_delay_s, c.seed) == (
        "rag-spike", 100.0, 1.0, 300.0, 0.0, 1)
