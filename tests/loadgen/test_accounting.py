"""The request ledger: one outcome per request, and what counts as lost."""

from __future__ import annotations

import pytest

from loadgen.accounting import Ledger, Outcome, classify, format_report
from loadgen.http_client import StreamResult


@pytest.mark.parametrize(("res", "kind", "retryable"), [
    (StreamResult("200", ok=True), "completed", False),
    (StreamResult("429", error="queue full"), "refused", True),
    (StreamResult("503", error="replica unavailable"), "refused", True),
    (StreamResult("400", error="prompt too long"), "refused", False),
    (StreamResult("500", error=""), "lost", False),  # an error without a message is not clear
    (StreamResult("stream", error="engine failed", error_event=True, started=True), "failed", True),
    (StreamResult("stream", error="stream ended without [DONE]", started=True), "lost", False),
    (StreamResult("timeout", error="no complete answer within 5 s"), "lost", False),
    (StreamResult("connection", error="reset"), "lost", False),  # before any answer
    (StreamResult("connection", error="payload not completed", started=True), "cut", True),
    (StreamResult("disconnected", error="client hung up"), "disconnected", False),
])
def test_classify(res, kind, retryable):
    out = classify(res)
    assert (out.kind, out.retryable) == (kind, retryable)


def test_a_request_without_an_outcome_is_lost_and_double_entries_are_refused():
    led = Ledger()
    for k in range(4):
        led.send(k)
    led.record(0, Outcome("completed", "200"))
    led.record(1, Outcome("refused", "429", "full", retryable=True))
    led.record(2, Outcome("lost", "timeout", "no answer"))
    with pytest.raises(ValueError, match="outcome already"):
        led.record(0, Outcome("completed", "200"))
    with pytest.raises(ValueError, match="never sent"):
        led.record(9, Outcome("completed", "200"))
    with pytest.raises(ValueError, match="sent twice"):
        led.send(3)
    rep = led.report()
    assert (rep["sent"], rep["completed"], rep["refused"], rep["lost"], rep["retryable"]) == (4, 1, 1, 2, 1)
    assert rep["lost_examples"] == [{"request": "2", "status": "timeout", "message": "no answer"},
                                    {"request": "3", "status": "", "message": "no outcome recorded"}]
    assert format_report(rep) == "sent 4: completed 1, refused 1 (429: 1), failed 0, disconnected 0, cut 0, lost 2"
