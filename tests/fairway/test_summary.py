"""The latency summary both hosts write (``fairway.summary``): end-to-end time, TPOT, served rate."""

from __future__ import annotations

import pytest

from fairway.summary import RequestSample, served_rate, summarize_samples


def sample(ttft: float, e2e: float | None, out: int) -> RequestSample:
    return RequestSample(ttft_s=ttft, queue_wait_s=None, lane="", prompt_tokens=10, cached_tokens=0,
                         work=1.0, e2e_s=e2e, output_tokens=out)


def test_e2e_and_tpot_over_the_samples_that_know_them():
    res = summarize_samples([sample(1.0, 3.0, 5), sample(2.0, 2.0, 1), sample(0.5, None, 9)])
    # e2e: the two samples with a known end; TPOT: only the one with two or more tokens
    assert res["e2e_s"]["n"] == 2 and res["e2e_s"]["mean"] == pytest.approx(2.5)
    assert res["tpot_s"]["n"] == 1 and res["tpot_s"]["p50"] == pytest.approx((3.0 - 1.0) / 4)


def test_no_end_known_gives_empty_dicts():
    res = summarize_samples([sample(1.0, None, 0)])
    assert res["e2e_s"]["n"] == 0 and res["tpot_s"]["n"] == 0


def test_served_rate_is_finished_over_first_start_to_last_finish():
    assert served_rate([0.0, 1.0, 2.0], [4.0, 5.0, 10.0]) == pytest.approx(3 / 10.0)
    assert served_rate([], []) == 0.0
    assert served_rate([1.0], [1.0]) == 0.0
