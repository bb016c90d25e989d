"""``bench.flow_live``'s arguments and scaling (its runs start a cluster: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench import flow_live


def test_objectives_scale_with_the_engines_speed():
    assert flow_live.classes(0.2) == [{"name": "interactive", "tier": 0, "objective_s": 5.0},
                                      {"name": "batch", "tier": 1, "objective_s": 150.0}]


@pytest.mark.parametrize("argv", [["--arms", "classes,nope"], ["--speed", "0"], ["--speed", "1.5"]])
def test_bad_arguments_exit_2_before_any_cluster_starts(argv, capsys, monkeypatch):
    monkeypatch.setattr(flow_live, "run_arm", lambda *a: pytest.fail("a cluster was started"))
    assert flow_live.main(argv) == 2
    assert "bad arguments" in capsys.readouterr().err


def test_rows_report_full_speed_seconds_and_batch_goodput():
    res = {"by_class": {"batch": {"n": 10, "n_finished": 9, "n_rejected": 1, "attainment": 0.8, "n_met": 8,
                                  "ttft_s": {"p50": 10.0, "p99": 50.0}}}}
    assert flow_live.rows("strict", res, 0.2, 4.0) == [
        "| strict | batch | 10 | 9 | 1 | 2.000 / 10.000 | 0.800 | 2.00 |"]
