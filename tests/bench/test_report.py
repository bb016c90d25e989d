"""``bench.report --side-by-side``: every policy of the sweeps in one matrix, medians over seeds."""

from __future__ import annotations

import json

import pytest

from bench.report import parse_args, side_by_side


def _row(policy: str, rate: float, p50: float, p99: float, hit: float = 0.5) -> dict:
    return {"label": policy, "rate_rps": rate, "ttft_s": {"p50": p50, "p99": p99, "mean": p50 * 2},
            "cache_hit_ratio": hit}


def test_the_matrix_takes_seed_medians_and_bolds_the_best_non_oracle(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    rows = [_row("fairway", 1, 0.1, 1.0), _row("fairway", 1, 0.3, 3.0), _row("fairway", 1, 0.2, 2.0),
            _row("lpm", 1, 0.05, 5.0), _row("srpt-oracle", 1, 0.01, 0.5), _row("fairway", 2, 0.4, 4.0)]
    (d / "sweep.json").write_text(json.dumps({"workload": "w", "seeds": [0, 1, 2], "results": rows}))
    out = side_by_side([(str(d), "w")])
    lines = out.splitlines()
    assert lines[2] == "| policy | w 1 | w 2 |"
    assert lines[4] == "| fairway | 0.200 / **2.00** | **0.400** / **4.00** |"  # the median seed; alone at load 2
    assert lines[5] == "| lpm | **0.050** / 5.00 | - |"
    assert lines[6] == "| srpt-oracle | 0.010 / 0.50 | - |"  # never marked


def test_the_command_line_names_a_folder_without_a_sweep(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([str(tmp_path)])
    assert e.value.code == 2
    assert f"{tmp_path}: no sweep.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(["--side-by-side", f"{tmp_path}=label"])
    assert f"{tmp_path}: no sweep.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args([])  # no folder: a usage error, not an empty report
    assert e.value.code == 2
