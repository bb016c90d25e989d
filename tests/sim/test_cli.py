"""The simulator CLI: bad input exits non-zero with one line naming the problem; a run writes JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fairway.spec import SpecError, parse_spec, resolve_spec, split_specs
from sim.cli import main


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sim", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workload", "rag", "--policy", "nope"], "unknown policy 'nope'"),
        (["--workload", "nope", "--policy", "fcfs"], "unknown workload 'nope'"),
        (["--workload", "trace:missing.jsonl", "--policy", "fcfs"], "missing.jsonl"),
        (["--workload", "rag", "--policy", "fairway[theta=-1]"], "theta"),
        (["--workload", "rag", "--policy", "fairway[lost_blocks=8;lost_scope=shared]"], "lost_scope"),
        (["--workload", "rag", "--policy", "fcfs", "--rate", "-2"], "rate"),
        (["--workload", "rag", "--policy", "fcfs", "--long-prefill-token-threshold", "-5"],
         "long_prefill_token_threshold"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle, capsys):
    rc = main(["run", *args, "--duration", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("sim: error:")


def test_malformed_trace_line_names_the_line(tmp_path, capsys):
    good = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + "{not json\n")
    rc = main(["run", "--workload", f"trace:{path}", "--policy", "fcfs"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and ":2" in err


def test_run_writes_json_through_the_real_entry_point(tmp_path):
    out = tmp_path / "r.json"
    p = cli("run", "--workload", "mixed", "--policy", "fairway", "--rate", "3", "--duration", "20",
            "--json", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["policy"] == "fairway" and res["n_finished"] == res["n_requests"] > 0
    bad = cli("run", "--workload", "mixed", "--policy", "nope")
    assert bad.returncode != 0 and "unknown policy" in bad.stderr


def test_sweep_writes_table_json_and_plots(tmp_path, capsys):
    rc = main(["sweep", "--workload", "rag", "--policies", "fcfs,fairway[theta=4]", "--rates",
               "2,4", "--duration", "10", "--out", str(tmp_path), "--jobs", "1"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "fairway[theta=4]" in table and "fcfs" in table
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["results"]) == 4
    assert (tmp_path / "ttft_vs_rate.png").stat().st_size > 1000
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000


def test_a_runs_cache_key_leaves_out_options_added_later_while_at_their_default():
    """Cached runs stay found when an option is added: ``RunConfig.key`` omits it at its default."""
    from sim.runner import RunConfig

    plain = RunConfig(workload="rag", policy="fcfs")
    capped = RunConfig(workload="rag", policy="fcfs", long_prefill_token_threshold=2048)
    assert "long_prefill_token_threshold" not in plain.key()
    assert plain.key() != capped.key() and '"long_prefill_token_threshold":2048' in capped.key()
    assert RunConfig.model_validate_json(plain.key()) == plain
    assert RunConfig.model_validate_json(capped.key()) == capped


def test_policy_spec_parsing():
    assert parse_spec("fairway[theta=4;fair_order=ratio]") == (
        "fairway", {"theta": 4, "fair_order": "ratio"})
    assert split_specs("a,b[x=1;y=2],c") == ["a", "b[x=1;y=2]", "c"]
    assert parse_spec(" lpm ") == ("lpm", {})
    with pytest.raises(SpecError, match="expected name"):
        parse_spec("fairway[theta=4")
    assert resolve_spec("fairway[theta=4]", {"fair_share": 0.5}) == ("fairway", {"theta": 4, "fair_share": 0.5})
    with pytest.raises(SpecError, match="given twice"):
        resolve_spec("fairway[theta=4]", {"theta": 6})


def _trace(tmp_path, gaps_s: list[float]):
    path = tmp_path / "t.jsonl"
    t, lines = 0.0, []
    for i, g in enumerate(gaps_s):
        t += g
        lines.append(json.dumps({"timestamp": int(t * 1000), "input_length": 40, "output_length": 2,
                                 "hash_ids": [i]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_replays_whole_unless_a_duration_is_given(tmp_path, capsys):
    path = _trace(tmp_path, [0.0] + [100.0] * 6)  # 7 requests over 600 s: past the synthetic default of 300 s
    out = tmp_path / "r.json"
    assert main(["run", "--workload", f"trace:{path}", "--policy", "fcfs", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n_requests"] == 7
    assert main(["run", "--workload", f"trace:{path}", "--policy", "fcfs", "--duration", "250",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n_requests"] == 3  # arrivals at 0, 100 and 200 s
    capsys.readouterr()


def test_run_prints_the_realised_rate_not_the_unused_rate_option(tmp_path, capsys):
    path = _trace(tmp_path, [0.0] + [0.5] * 10)  # 2 req/s; --rate's default (4) does not apply
    assert main(["run", "--workload", f"trace:{path}", "--policy", "fcfs"]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[1] == "req/s"
    assert float(row.split()[1]) == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize(("extra", "view", "delay"), [
    ([], "shared", 0.0),  # one router: nobody to sync with
    (["--routers", "4"], "shared", 0.01),  # the cluster's default: one shared view, its sync period
    (["--routers", "4", "--sync-delay", "0"], "shared", 0.0),
    (["--routers", "4", "--router-view", "own"], "own", 0.0),
])
def test_several_routers_default_to_the_clusters_shared_view(extra, view, delay):
    from sim.cli import make_parser
    from sim.options import config_from

    args = make_parser().parse_args(["run", "--workload", "rag", "--policy", "fcfs", *extra])
    cfg = config_from(args, args.policy, args.rate, args.seed)
    assert (cfg.router_view, cfg.sync_delay_s) == (view, delay)


def test_run_reports_end_to_end_time_tpot_and_served_rate():
    """The closed loop's delivered rate and each request's end-to-end time and TPOT, from the
    engine's records (a run's summary is what ``sim run --json`` writes)."""
    from sim.runner import RunConfig, build, run

    cfg = RunConfig(workload="agentic", policy="fcfs", rate=0.5, concurrency=4, duration_s=20, seed=1)
    res = run(cfg)
    sim, _ = build(cfg)
    done = sim.run().finished
    e2e = sorted(r.finished_s - r.spec.arrival_s for r in done)
    span = max(r.finished_s for r in done) - min(r.spec.arrival_s for r in done)
    assert res["served_rps"] == pytest.approx(len(done) / span)
    assert res["e2e_s"]["n"] == len(done) and res["e2e_s"]["max"] == pytest.approx(e2e[-1])
    assert res["e2e_s"]["max"] >= res["ttft_s"]["max"] and res["tpot_s"]["n"] > 0
