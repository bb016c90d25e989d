"""bench.flow: the verdicts against the issue's targets, and one tiny end-to-end table."""

from __future__ import annotations

import pytest

from bench.flow import ARMS, PRODUCT, main, verdicts


def row(**kw):
    base = {"int_p50": 0.1, "int_p99": 0.5, "int_att": 1.0, "batch_p50": 1.0, "batch_p99": 5.0,
            "batch_goodput": 10.0, "batch_att": 1.0, "batch_over": 0, "refused": 0, "refused_room": 0,
            "p50": 0.1, "p99": 1.0}
    return {**base, **kw}


def test_verdicts_judge_the_product_arm_against_the_best_anchor_on_either_engine():
    assert PRODUCT == "classes-strict"  # replica.strict_tiers is on by default with two tiers
    rows = {("w", 0.5, a): row() for a in ARMS}
    rows["w", 0.5, PRODUCT] = row(p99=1.03)
    rows["w", 0.5, "classes"] = row(p99=5.0)  # not the product: not judged
    rows.update({("w", 2.0, a): row(batch_goodput=9.0) for a in ARMS})
    rows["w", 2.0, "llmd-flow-strict"] = row(batch_goodput=11.0)  # the best anchor, on the strict engine
    rows["w", 2.0, PRODUCT] = row(int_p99=0.7, int_att=0.995, batch_goodput=10.5, refused_room=1)
    out = verdicts(rows, {"w": 0.5}, [0.5, 2.0])
    assert out[0] == ("w 2x: interactive p99 0.700 s vs 1.5 x idle 0.750 s: met; attainment 0.9950: met; batch "
                      "goodput 10.50 vs best anchor 11.00 req/s: MISSED; batch past its bound 0: met")
    assert out[1] == "w 0.5x: p50 1.000x, p99 1.030x of default: MISSED"
    assert out[2] == "w: refusals while a replica had room (classes-strict, all loads) 1: MISSED"
    without_strict_anchors = {k: v for k, v in rows.items() if not k[2].endswith("-strict") or k[2] == PRODUCT}
    assert "best anchor 9.00 req/s: met" in verdicts(without_strict_anchors, {"w": 0.5}, [2.0])[0]
    some = {k: v for k, v in rows.items() if k[2] in ("classes", "classes-strict")}
    assert verdicts(some, {"w": 0.5}, [0.5, 2.0]) == [
        "verdicts need the arms classes-strict, default, priority-fcfs, llmd-flow: not all run"]


@pytest.mark.slow  # about 6 s: sixteen 8-replica simulator runs
def test_a_tiny_run_prints_every_arm_and_the_verdicts(capsys, tmp_path):
    assert main(["--workloads", "rag", "--loads", "0.5,2", "--duration", "4", "--capacity", "rag=20",
                 "--jobs", "1", "--out", str(tmp_path / "flow.json")]) == 0
    out = capsys.readouterr().out
    for arm in ARMS:
        assert f"| rag | 2x (40/s) | {arm} |" in out, arm
    assert "rag 2x: interactive p99" in out and "rag 0.5x: p50" in out
    assert (tmp_path / "flow.json").exists()
