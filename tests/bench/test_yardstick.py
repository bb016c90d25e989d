"""The yardstick's table: best anchor per metric over seed medians, ratios, verdict; one real run."""

from __future__ import annotations

import pytest

from bench.yardstick import DEFAULT_MAX_NUM_SEQS, FAIRWAY, Point, Run, render, run_one, summarise, verdict


def result(router: str, p50: float, p99: float, hit: float, seed: int = 0, point: str = "w @1",
           view: str = "approx", bound: float = 0.5) -> dict:
    return {"point": point, "router": router, "view": view, "seed": seed,
            "ttft_s": {"p50": p50, "p99": p99, "mean": (p50 + p99) / 2}, "hit": hit, "hit_bound": bound,
            "n_finished": 10, "n_requests": 10, "sim_wall_s": 0.1}


def test_best_anchor_per_metric_over_seed_medians():
    rs = [
        # fairway: medians p50 1.0, p99 10
        result(FAIRWAY, 1.0, 10, 0.30, 0), result(FAIRWAY, 0.8, 12, 0.30, 1), result(FAIRWAY, 1.2, 9, 0.30, 2),
        # a: best p50 (median 0.9), worse p99
        result("a", 0.9, 20, 0.20, 0), result("a", 0.5, 30, 0.20, 1), result("a", 2.0, 25, 0.20, 2),
        # b: best p99 (median 8) and hit, worse p50
        result("b", 1.5, 8, 0.40, 0), result("b", 1.6, 7, 0.40, 1), result("b", 1.4, 9, 0.40, 2),
        # an ablation with better everything is not an anchor, so it never counts
        result("consistent-hash", 0.1, 1, 0.9, 0),
    ]
    (row,) = summarise(rs, anchors=["a", "b"])
    assert row.best["p50"] == ("a", 0.9)
    assert row.best["p99"] == ("b", 8)
    assert row.best["hit"] == ("b", 0.40)
    assert row.ratio["p50"] == pytest.approx(1.0 / 0.9)
    assert row.ratio["p99"] == pytest.approx(10 / 8)
    assert row.fairway["seeds"] == 3
    assert "consistent-hash" in row.routers  # shown, not compared


def test_points_and_views_are_separate_rows_in_first_seen_order():
    rs = [result(FAIRWAY, 1, 2, 0.1, point="p2"), result("a", 1, 2, 0.1, point="p2"),
          result(FAIRWAY, 1, 2, 0.1, point="p1"), result("a", 2, 4, 0.1, point="p1"),
          result(FAIRWAY, 1, 2, 0.1, point="p1", view="events"), result("a", 1, 1, 0.1, point="p1", view="events"),
          result("a", 1, 1, 0.1, point="p3")]  # p3 has no Fairway run: left out
    rows = summarise(rs, anchors=["a"])
    assert [(r.point, r.view) for r in rows] == [("p2", "approx"), ("p1", "approx"), ("p1", "events")]
    assert [r.ratio["p99"] for r in rows] == [1.0, 0.5, 2.0]


def test_verdict_targets():
    good = summarise([result(FAIRWAY, 0.9, 8, 0.5, point=f"p{i}") for i in range(3)]
                     + [result("a", 1.0, 10, 0.4, point=f"p{i}") for i in range(3)], ["a"])
    v = verdict(good)
    assert (v.median_p50, v.median_p99, v.hit_shortfalls) == (pytest.approx(0.9), pytest.approx(0.8), [])
    assert v.met
    # one point 1.06x behind on p99 fails "no point above 1.05", whatever the median
    bad = summarise([result(FAIRWAY, 0.9, 10.6, 0.5, point="p0")] + [result(FAIRWAY, 0.9, 8, 0.5, point=f"p{i}")
                    for i in (1, 2)] + [result("a", 1.0, 10, 0.6, point=f"p{i}") for i in range(3)], ["a"])
    v = verdict(bad)
    assert v.max_p99 == pytest.approx(1.06)
    assert v.hit_shortfalls == ["p0", "p1", "p2"]
    assert not v.met
    text = render(bad, missing=["real (x.jsonl)"])
    assert "**1.06**" in text and "not met" in text and "real (x.jsonl)" in text


def test_one_real_run_through_the_simulator():
    p = Point("rag", "rag", 4, 20)
    r1, r2 = run_one(Run(p, FAIRWAY, "approx", 0, replicas=2)), run_one(Run(p, "pow2", "approx", 0, replicas=2))
    assert r1["n_finished"] == r1["n_requests"] > 0
    assert 0 <= r1["hit"] <= r1["hit_bound"] <= 1
    (row,) = summarise([r1, r2], ["pow2"])
    assert row.best["p99"][0] == "pow2"
    assert row.ratio["p99"] == pytest.approx(r1["ttft_s"]["p99"] / r2["ttft_s"]["p99"])
    assert Run(p, "pow2", "approx", 0).key != Run(p, "pow2", "events", 0).key


def test_the_slot_count_reaches_the_engine_and_keeps_the_default_runs_cache():
    p = Point("rag", "rag", 4, 20)
    default, one = Run(p, FAIRWAY, "approx", 0, replicas=2), Run(p, FAIRWAY, "approx", 0, replicas=2, max_num_seqs=1)
    assert default.config().max_num_seqs == DEFAULT_MAX_NUM_SEQS == 1024 and one.config().max_num_seqs == 1
    assert default.key != one.key != Run(p, FAIRWAY, "approx", 0, replicas=2, max_num_seqs=256).key
    # one slot per replica: every request waits for the one before it to finish decoding
    r_default, r_one = run_one(default), run_one(one)
    assert r_one["n_finished"] == r_default["n_finished"] > 0
    assert r_one["ttft_s"]["p99"] > 2 * r_default["ttft_s"]["p99"]
    assert r_one["slots"]["peak_running"] == 1 and r_default["slots"]["bound_step_fraction"] == 0
    # a table of other engines says so above it
    rows = summarise([r_one], anchors=[])
    assert render(rows, max_num_seqs=1).startswith("Engines with 1 sequence slots per replica (default 1024)")
    assert "sequence slots" not in render(rows)


def test_a_point_missing_an_anchor_is_shown_incomplete_and_left_out_of_the_verdict():
    rs = [result(FAIRWAY, 1, 2, 0.1, point="p1"), result("a", 2, 4, 0.1, point="p1"),
          result("b", 2, 4, 0.1, point="p1"),
          result(FAIRWAY, 1, 9, 0.1, point="p2"), result("a", 1, 1, 0.1, point="p2")]  # no "b" at p2
    rows = summarise(rs, anchors=["a", "b"])
    assert [(r.point, r.missing) for r in rows] == [("p1", []), ("p2", ["b"])]
    text = render(rows, not_run=["p3"])
    assert "incomplete: 1 anchor(s) not run (b)" in text
    assert "over the 1 complete points: p50 median 0.50" in text and "p99 median 0.50" in text
    assert "Points not run yet: p3." in text


def test_admissible_p50_leaves_out_anchors_that_buy_the_median_with_the_tail():
    rs = [result(FAIRWAY, 1.0, 10, 0.3),
          result("starver", 0.5, 500, 0.3),  # best p50, p99 50x the best: not admissible
          result("tail", 1.2, 10, 0.3),  # best p99
          result("mid", 0.8, 20, 0.3)]  # p99 exactly 2x the best: admissible
    (row,) = summarise(rs, anchors=["starver", "tail", "mid"])
    assert row.best["p50"] == ("starver", 0.5)
    assert row.admissible == ("mid", 0.8)
    assert row.ratio["p50_admissible"] == pytest.approx(1.25)
    v = verdict([row])
    assert (v.median_p50_admissible, v.max_p50_admissible) == (pytest.approx(1.25), pytest.approx(1.25))
    assert "**1.25** (mid)" in render([row])


def test_admissible_hit_leaves_out_anchors_that_buy_the_hit_with_the_tail():
    rs = [result(FAIRWAY, 1.0, 10, 0.40),
          result("hoarder", 2.0, 500, 0.60),  # best hit, p99 50x the best: not admissible
          result("tail", 1.2, 10, 0.30),  # best p99
          result("sticky", 1.1, 20, 0.45)]  # p99 exactly 2x the best: admissible, more hit than Fairway
    (row,) = summarise(rs, anchors=["hoarder", "tail", "sticky"])
    assert row.best["hit"] == ("hoarder", 0.60)
    assert row.admissible_hit == ("sticky", 0.45)
    v = verdict([row])
    assert v.hit_shortfalls == v.hit_shortfalls_admissible == ["w @1"]
    assert "| 0.600 (hoarder) | 0.450 (sticky) |" in render([row])
    # without the admissible anchor, Fairway's hit is the best of those left
    (row,) = summarise(rs[:3], anchors=["hoarder", "tail"])
    assert row.admissible_hit == ("tail", 0.30)
    v = verdict([row])
    assert (v.hit_shortfalls, v.hit_shortfalls_admissible) == (["w @1"], [])
    assert "hit below the best of those at 0 point(s)." in render([row])


def test_a_candidate_is_judged_in_fairways_place():
    rs = [result(FAIRWAY, 1.0, 10, 0.3), result("fairway[x=1]", 0.5, 5, 0.3), result("a", 1.0, 10, 0.3)]
    (row,) = summarise(rs, anchors=["a"], fairway="fairway[x=1]")
    assert row.ratio["p50"] == pytest.approx(0.5) and row.ratio["p99"] == pytest.approx(0.5)
    assert "Judged as Fairway: `fairway[x=1]`" in render([row], fairway="fairway[x=1]")


def test_a_target_under_the_ttft_floor_is_named_beyond_any_router():
    """The best anchor's p99 is 0.44 s and the floor of Fairway's requests 0.425 s: p99 <= 0.9x
    (0.396 s) is out of any router's reach, 1.05x (0.462 s) is not; a run cached before the floor
    was kept shows a dash."""
    floor = {"p50": 0.006, "p99": 0.425, "mean": 0.03}
    rs = [{**result(FAIRWAY, 0.014, 0.49, 0.8, seed=s), "ttft_floor_s": floor} for s in (0, 1)]
    rs += [result("dynamo", 0.015, 0.44, 0.8, seed=s) for s in (0, 1)]
    (row,) = summarise(rs, anchors=["dynamo"])
    assert row.floor == {"p50": 0.006, "p99": 0.425}
    assert row.beyond_reach() == ["p99 <= 0.9x"]
    text = render([row])
    assert "| 0.006 / 0.42 |" in text and "w @1 (p99 <= 0.9x)" in text
    (old,) = summarise([result(FAIRWAY, 0.014, 0.49, 0.8), result("dynamo", 0.015, 0.44, 0.8)], anchors=["dynamo"])
    assert old.floor == {} and old.beyond_reach() == [] and "| - |" in render([old])


def test_the_floor_comes_with_every_real_run():
    r = run_one(Run(Point("hotspot", "hotspot", 40, 10), FAIRWAY, "approx", 0, replicas=2))
    f = r["ttft_floor_s"]
    assert set(f) == {"p50", "p99", "mean"}
    assert 0 < f["p50"] <= r["ttft_s"]["p50"] and 0 < f["p99"] <= r["ttft_s"]["p99"]


def test_an_anchor_better_on_every_count_at_once_is_named():
    rs = [result(FAIRWAY, 1.0, 10, 0.40),
          result("hoarder", 2.0, 50, 0.60),  # more hit, worse quantiles: not dominating
          result("fast", 0.5, 12, 0.40),  # better p50 only: not dominating
          result("equal", 1.0, 10, 0.40),  # the same on all three: not dominating
          result("better", 1.0, 9, 0.40)]  # no worse anywhere, better p99: dominating
    (row,) = summarise(rs, anchors=["hoarder", "fast", "equal", "better"])
    assert row.dominated_by == ["better"]
    v = verdict([row])
    assert v.dominated == ["w @1 (better)"]
    assert "and better on one, at 1 point(s): w @1 (better)." in render([row])
    (row,) = summarise(rs[:4], anchors=["hoarder", "fast", "equal"])
    assert row.dominated_by == [] and verdict([row]).dominated == []
    assert "and better on one, at 0 point(s)." in render([row])
