"""The scale-out benchmark's run plan: a point names a trace at a time scale or a workload at a rate."""

from __future__ import annotations

from bench.scaleout import config, members, summary_row


def test_a_trace_point_replays_the_whole_trace_at_its_time_scale():
    c = config("mooncake@3", routers=4, view="shared", delay=0.02, seed=0)
    assert c.workload.startswith("trace:") and c.workload.endswith("mooncake_synthetic_trace.jsonl")
    assert (c.time_scale, c.duration_s, c.routers, c.router_view, c.sync_delay_s) == (3.0, None, 4, "shared", 0.02)
    assert (c.replicas, c.router, c.policy, c.index_mode) == (8, "fairway", "fairway", "approx")
    assert config("mooncake@3", routers=4, view="shared", delay=0.02, seed=0, index="events").index_mode == "events"


def test_a_synthetic_point_runs_at_its_rate_and_own_views_have_no_delay():
    c = config("rag-spike@100", routers=4, view="own", delay=0.02, seed=1)
    assert (c.workload, c.rate, c.time_scale, c.duration_s, c.sync_delay_s, c.seed) == (
        "rag-spike", 100.0, 1.0, 300.0, 0.0, 1)


def test_an_ensemble_spreads_a_trace_load_within_one_percent_and_a_workload_over_seeds():
    assert members("mooncake@3", 5, 0) == [("mooncake@2.97", 0), ("mooncake@2.985", 0), ("mooncake@3", 0),
                                            ("mooncake@3.015", 0), ("mooncake@3.03", 0)]
    assert members("hotspot@160", 3, 2) == [("hotspot@160", 2), ("hotspot@160", 3), ("hotspot@160", 4)]
    assert members("mooncake@3", 1, 0) == [("mooncake@3", 0)]


def _res(p50: float, p99: float, hit: float = 0.5) -> dict:
    return {"ttft_s": {"p50": p50, "p99": p99}, "cache_hit_ratio": hit, "hit_bound_capacity": 0.6}


def test_a_row_is_the_members_medians_against_the_one_router_medians():
    base = [_res(1.0, 10.0), _res(1.0, 8.0), _res(1.0, 9.0)]
    row = summary_row("m@1", 4, "shared", [_res(2.0, 12.0, 0.4), _res(1.0, 8.0), _res(3.0, 9.9)], base)
    # median p99 9.9 / median base 9.0 = 1.10; member ratios 1.2, 1.0, 1.1
    assert row == ["m@1", 4, "shared", "2.000", "9.90", "0.500", "0.600", "1.10", "1.00-1.20"]
    assert summary_row("m@1", 1, "own", base, None)[-2:] == ["-", "-"]
