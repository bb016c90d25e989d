"""``bench.tier_wait``'s summary and arguments (its runs start clusters: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench.tier_wait import main, summary


def _round(sent: float, inter: float, batch: float) -> dict:
    return {"interactive_sent_s": sent, "interactive_ttft_s": inter, "batch_ttft_s": batch,
            "interactive_first": sent + inter < batch}


def test_summary_counts_only_rounds_sent_before_the_batch_first_token():
    rounds = [_round(0.15, 0.04, 0.70), _round(0.15, 0.06, 0.80), _round(0.15, 0.55, 0.68),
              _round(0.70, 0.02, 0.69)]  # the last left after the batch prompt's first token
    assert summary("strict", rounds) == ("strict  3/4 rounds: interactive TTFT p50 0.060 s (0.040-0.550), "
                                         "batch TTFT p50 0.700 s (0.680-0.800), interactive first 2")
    assert "no round" in summary("fcfs", [_round(0.9, 0.02, 0.69)])


def test_an_unknown_arm_is_refused_before_any_cluster_starts(capsys):
    with pytest.raises(SystemExit):
        main(["--arms", "fcfs,fifo"])
    assert "unknown arm 'fifo'; known: fcfs, strict" in capsys.readouterr().err
