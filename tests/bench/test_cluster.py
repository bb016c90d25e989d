"""The cluster benchmark tooling without a cluster: tables, report assembly, the overhead
statistics, the process helpers and the sim engine's real-time pacing figures."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest

from bench.cluster import router_specs, run_order
from bench.machine import is_descendant, port_listening
from bench.overhead import family_prompt, ingress_cpu, offline_routing, paired_diffs, summarize
from bench.recording import code_fingerprint, foreign_replicas
from bench.tables import (
    code_versions,
    md_table,
    overhead_table,
    pairs_table,
    ratio,
    report,
    routers_table,
    sim_vs_real_table,
)


def pct(p50: float, p90: float, p99: float, n: int = 10) -> dict:
    return {"p50": p50, "p90": p90, "p99": p99, "mean": (p50 + p99) / 2, "max": p99, "n": n}


def run_json(p50: float, hit: float, split: tuple[int, ...] = (6, 4), **extra) -> dict:
    return {
        "ttft_s": pct(p50, 2 * p50, 4 * p50, sum(split)),
        "ttft_by_lane_s": {"fast": {"p50": p50, "p99": 4 * p50, "n": sum(split)}},
        "ttft_by_class_s": {"cheap": {"p50": p50, "p99": p50, "n": 9}, "expensive": {"p50": 1.0, "p99": 2.0, "n": 1}},
        "cache_hit_ratio": hit,
        "n_finished": sum(split),
        "n_requests": sum(split),
        "per_replica": [{"replica": f"r{i}", "requests": k, "hit_ratio": hit} for i, k in enumerate(split)],
        **extra,
    }


def test_md_table_alignment_and_number_format():
    t = md_table(["name", "a", "b"], [["x", 1.23456, 7], ["y", None, "-"]])
    lines = t.splitlines()
    assert lines[0] == "| name | a | b |"
    assert lines[1] == "| --- | ---: | ---: |"
    assert lines[2] == "| x | 1.235 | 7 |"
    assert lines[3] == "| y | - | - |"
    assert md_table(["a", "b"], [], align="ll").splitlines()[1] == "| --- | --- |"


def test_ratio_handles_missing_and_zero():
    assert ratio(2.0, 1.0) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_summarize_pairs_differences_within_rounds():
    rounds = [{"http": 0.030, "handle": 0.012, "actor": 0.011, "health": 0.004},
              {"http": 0.028, "handle": 0.013, "actor": 0.010, "health": 0.005},
              {"http": 0.032, "handle": 0.011}]  # a round without the actor path
    res = summarize(rounds, {"ingress_ttft": [0.01, 0.02]})
    assert res["paths_ms"]["http"]["n"] == 3 and res["paths_ms"]["actor"]["n"] == 2
    assert res["paths_ms"]["http"]["p50"] == pytest.approx(30.0)
    d = res["diffs"]["http-handle"]
    assert d["paired"]["n"] == 3
    assert d["p50_of_diff_ms"] == pytest.approx(18.0)
    assert res["diffs"]["handle-actor"]["paired"]["n"] == 2
    assert paired_diffs(rounds, "handle", "actor") == pytest.approx([0.001, 0.003])
    assert res["extra_ms"]["ingress_ttft"]["p50"] == pytest.approx(15.0)


def test_overhead_table_has_every_section():
    res = summarize([{"http": 0.03, "handle": 0.012, "actor": 0.011, "health": 0.004}] * 3, {})
    res.update({"prompt_tokens": 8192, "decision_us": pct(120.0, 200.0, 900.0, 30),
                "offline_routing": [{"router": "fairway", "replicas": 16, "prompt_tokens": 8192,
                                     "p50_us": 130.0, "p99_us": 400.0}],
                "ingress_cpu_ms": {"json_decode": pct(0.3, 0.4, 0.5), "validate": pct(0.2, 0.3, 0.4)},
                "errors": {"actor": "boom"}})
    t = overhead_table(res)
    for needle in ("| http | 30.000", "| http-handle | 18.000", "driver's FairwayRequestRouter",
                   "offline `bench.routing` fairway | 16", "| sum of p50s | 0.500", "errors: actor: boom"):
        assert needle in t, needle


def test_sim_vs_real_table_ratios_and_engine_rows():
    sim = run_json(0.010, 0.72)
    real = run_json(0.012, 0.70, send_lag_s=pct(0.001, 0.002, 0.004), itl_s=pct(0.006, 0.007, 0.01),
                    e2e_s=pct(0.8, 1.0, 2.0), n_rejected=0, n_unfinished=0)
    eng = [{"replica": "SERVE::abcdefgh", "timing": {"modelled_busy_s": 10.0, "wall_busy_s": 10.1, "slowdown": 1.01,
                                                      "late_ms_p50": 0.5, "late_ms_p99": 3.0, "written_off_s": 0.0}}]
    t = sim_vs_real_table(sim, {"deadline": real}, {"deadline": eng})
    assert "| real/sim (deadline) | 1.200 | 1.200 | 1.200 |" in t
    assert "| deadline | abcdefgh | 10.000 | 10.100 | 1.010 |" in t
    assert "| deadline | 4.000 | 6.000 | 0.800 | 0 | 0 |" in t
    assert "6/4" in t


def test_routers_table_rows_for_cluster_and_sim():
    t = routers_table({"fairway": run_json(0.02, 0.7, (9, 1), errors_by_status={"429": 2}, loadavg=[1.25, 3.0])},
                      {"fairway": run_json(0.01, 0.72)})
    assert "| fairway (cluster) | 0.020 |" in t and "| fairway (sim) | 0.010 |" in t
    assert "9/1" in t and "429:2" in t and "| 1.2/3.0 |" in t


def test_report_assembles_tables_from_a_folder(tmp_path):
    (tmp_path / "simreal-sim.json").write_text(json.dumps(run_json(0.01, 0.7)))
    (tmp_path / "simreal-real-deadline.json").write_text(json.dumps(run_json(0.011, 0.7)))
    (tmp_path / "simreal-meta.json").write_text(json.dumps({"workload": "mixed", "rate": 2, "runs": ["deadline"]}))
    runs = ["fairway-r1", "pow2-r1", "pow2-r2", "fairway-r2"]
    (tmp_path / "routers-meta.json").write_text(json.dumps({"workload": "rag-spike", "policies": ["fairway", "pow2"],
                                                             "runs": runs}))
    (tmp_path / "routers-fairway-r1.json").write_text(json.dumps(run_json(0.02, 0.6)))
    (tmp_path / "routers-fairway-r2.json").write_text(json.dumps(run_json(0.04, 0.6)))
    text = report(tmp_path)
    assert "### Simulated vs real TTFT" in text and "### Routers on the cluster" in text
    assert "| real (deadline) | 0.011 |" in text
    assert "### Router overhead" not in text  # no overhead.json: section skipped
    assert "pow2" not in text.split("### Routers on the cluster")[1].split("\n", 1)[1]  # missing runs skipped
    assert "| fairway | 2 | 0.030 |" in text  # median over the two fairway runs
    assert (tmp_path / "tables.md").read_text() == text


def test_run_order_alternates_direction():
    assert run_order(["a", "b", "c"], 1) == [("a", "a"), ("b", "b"), ("c", "c")]
    assert [t for _, t in run_order(["a", "b"], 3)] == ["a-r1", "b-r1", "b-r2", "a-r2", "a-r3", "b-r3"]


def test_router_specs_take_optional_tags():
    assert router_specs("fairway,prev=fairway[rule=affinity;wait_model=fcfs],llmd[w_kv=1]") == {
        "fairway": "fairway", "prev": "fairway[rule=affinity;wait_model=fcfs]", "llmd[w_kv=1]": "llmd[w_kv=1]"}


def test_foreign_replicas_are_named():
    res = run_json(0.01, 0.5, (3, 2))
    assert foreign_replicas(res, [{"replica": "r0"}, {"replica": "r1"}]) == []
    assert foreign_replicas(res, [{"replica": "r0"}]) == ["r1"]


def test_process_helpers():
    assert is_descendant(os.getpid(), os.getpid())
    assert is_descendant(os.getpid(), os.getppid())
    assert not is_descendant(os.getppid(), os.getpid())
    assert port_listening(1) is False


def test_family_prompts_are_deterministic_and_distinct():
    a, b = family_prompt(0, 64), family_prompt(1, 64)
    assert a == family_prompt(0, 64) and a != b
    assert min(a) >= 16 and max(a) < 4096 and len(a) == 64


def test_offline_parts_run_small():
    rows = offline_routing(replicas=(2,), routers=("fairway",), prompt_tokens=256, cycles=20)
    assert rows[0]["router"] == "fairway" and rows[0]["p50_us"] > 0
    cpu = ingress_cpu(prompt_tokens=256, reps=3)
    assert set(cpu) == {"json_decode", "validate", "hash_blocks", "pickle_call"}
    assert all(v["n"] == 3 for v in cpu.values())


@pytest.mark.parametrize("pacing", ["deadline", "sleep"])
def test_sim_engine_reports_pacing(pacing):
    """One request with the event loop blocked for ``stall`` after its first token (as a long GC
    pause would): the deficit beyond ``max_catchup_s`` is written off under either pacing; the
    deadline loop repays the rest in a burst (the steps after the stall all run late), the plain
    sleep loop never catches up (only the first step after the stall is late)."""
    from fairway.hashing import block_hashes
    from fairway.protocol import GenerateCall
    from replicas.engines.sim_engine import SimEngine

    stall, catchup = 0.3, 0.1

    async def go() -> dict:
        e = SimEngine(kv_blocks=2000, pacing=pacing, speed=4.0, max_catchup_s=catchup)
        await e.start()
        ids = np.random.default_rng(0).integers(16, 4096, size=512).tolist()
        call = GenerateCall("r", ids, tuple(block_hashes(ids, 16)), 8, time.time())
        n = 0
        async for o in e.generate(call):
            if n == 0:
                time.sleep(stall)  # blocks the loop: the engine's next step starts this late
            n += len(o.token_ids)
        await asyncio.sleep(0.01)
        t = e.timing()
        await e.shutdown()
        assert n == 8
        return t

    t = asyncio.run(go())
    assert t["pacing"] == pacing and t["steps"] == 8
    assert t["modelled_busy_s"] > 0 and t["wall_busy_s"] >= max(t["modelled_busy_s"] * 0.9, stall)
    assert t["written_off_s"] >= stall - catchup - 0.02, t  # not repaid
    assert t["late_ms_p50"] > -1.0  # the loop may wake a hair early
    if pacing == "deadline":
        assert t["late_ms_p50"] > catchup * 1e3 / 2, t  # up to max_catchup_s repaid in a burst
    else:
        assert t["late_ms_p50"] < catchup * 1e3 / 2, t


def test_sim_engine_rejects_bad_pacing():
    from replicas.engines.sim_engine import SimEngine

    with pytest.raises(ValueError, match="pacing"):
        SimEngine(pacing="fast")
    with pytest.raises(ValueError, match="max_catchup_s"):
        SimEngine(max_catchup_s=-1)


def test_code_fingerprint_follows_the_code_and_ignores_reporting(tmp_path):
    for d in ("fairway", "router", "replicas", "sim", "loadgen", "deploy", "bench"):
        (tmp_path / d).mkdir()
    (tmp_path / "router" / "a.py").write_text("x = 1\n")
    (tmp_path / "deploy" / "cluster.yaml").write_text("a: 1\n")
    fp = code_fingerprint(tmp_path)
    (tmp_path / "bench" / "cluster.py").write_text("# reporting\n")
    assert code_fingerprint(tmp_path) == fp
    (tmp_path / "router" / "a.py").write_text("x = 2\n")
    assert code_fingerprint(tmp_path) != fp
    fp = code_fingerprint(tmp_path)
    (tmp_path / "fairway" / "core.py").write_text("y = 1\n")  # the core counts too
    assert code_fingerprint(tmp_path) != fp


def test_code_versions_warns_on_mixed_code(tmp_path):
    assert "not recorded" in code_versions(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"code": "abc", "code_at_end": "abc"}))
    assert "abc for every run" in code_versions(tmp_path)
    (tmp_path / "b.json").write_text(json.dumps({"code": "def", "code_at_end": "fed"}))
    text = code_versions(tmp_path)
    assert text.startswith("WARNING") and "- def: b" in text and "changed during: b" in text
    (tmp_path / "a.json").write_text(json.dumps({"code": "abc", "code_files": {"x.py": "1", "y.py": "2"}}))
    (tmp_path / "b.json").write_text(json.dumps({"code": "def", "code_files": {"x.py": "1", "y.py": "3"}}))
    assert "files that differ: y.py" in code_versions(tmp_path)


def test_pairs_table_compares_requests_by_rid():
    sim = {0: {"ttft_s": 0.01, "kind": "cheap", "prompt_tokens": 100, "cached_tokens": 96, "replica": 0},
           1: {"ttft_s": 0.20, "kind": "cold", "prompt_tokens": 4000, "cached_tokens": 0, "replica": 1}}
    real = {"requests": [
        {"rid": 0, "kind": "cheap", "prompt_tokens": 100, "cached_tokens": 96, "ttft_s": 0.04, "server_ttft_s": 0.02},
        {"rid": 1, "kind": "cold", "prompt_tokens": 4000, "cached_tokens": 16, "ttft_s": 0.30, "server_ttft_s": 0.25},
        {"rid": 2, "kind": "cold", "prompt_tokens": 10, "cached_tokens": 0, "ttft_s": 9.0, "server_ttft_s": 9.0}]}
    t = pairs_table({"deadline": real}, sim, top=2)
    assert "| deadline | cheap | 1 | 30.000 | 30.000 | 10.000 | 10.000 | 1.000 |" in t
    assert "| deadline | cold | 1 | 100.000 |" in t and "| 0.000 |" in t  # cached tokens differ
    assert "| deadline | 1 | cold | 4000 | 16/0 | 0.300 | 0.250 | 0.200 |" in t  # rid 2 has no sim twin
    assert pairs_table({"x": {"requests": []}}, sim) == ""
