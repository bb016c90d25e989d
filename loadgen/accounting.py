"""Every request accounted for: exactly one outcome per request sent.

Why: a router sits in front of every request, and the failure that matters most is the silent one
(a request dropped, a client left waiting). The ledger takes each request when it is sent and its
outcome when the client is done with it; what has no outcome, or an outcome that is not a clear
answer, is lost. Every reliability test asserts lost = 0.

Outcome kinds, from the client's ``StreamResult`` (``loadgen/http_client.py``):

- ``completed``: a whole answer (the stream ended with ``[DONE]`` or its usage chunk);
- ``refused``: a non-2xx status with an error message; ``retryable`` for 429, 503 and 504 (which carry
  Retry-After, or name a stalled replica), not for a 4xx about the request itself;
- ``failed``: a stream that began and then ended with the server's error event (a clear failure);
- ``disconnected``: the client hung up on purpose (not the server's doing);
- ``cut``: a stream that began and whose HTTP response then broke off (an incomplete chunked
  body, a reset): the client's HTTP library reports it at once as a transport error, so nothing
  hangs and the client can retry; it is what a process that dies while holding the stream (a
  killed ingress replica) leaves. Counted apart from ``lost`` because it is not silent, and
  reported beside it, since a stricter reading ("every stream ends with ``[DONE]`` or an error
  event") counts it as lost;
- ``lost``: anything else: no answer within the client's time limit (a hang), a stream that
  ended cleanly without ``[DONE]`` or an error event (a silent truncation), a connection that
  failed before any answer, an error status without a message, or a request with no outcome
  recorded at all.

Beside the kinds, ``resent`` counts the requests the client sent a second time because their
reused keep-alive connection closed before any answer (``loadgen/http_client.py``); each has
its one outcome like any other.

Complexity: O(1) per request; memory O(requests) for the outcomes (a few fields each).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from loadgen.http_client import RETRYABLE, StreamResult

KINDS = ("completed", "refused", "failed", "disconnected", "cut", "lost")
#: Lost requests whose details a report lists (the count is always exact).
LOST_EXAMPLES = 5


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request came to: ``kind`` (one of ``KINDS``), the HTTP status or the client's
    status word, the message the client got, whether the client should retry, and whether it was
    sent a second time after its reused connection closed unanswered."""

    kind: str
    status: str
    message: str = ""
    retryable: bool = False
    resent: bool = False


def classify(res: StreamResult) -> Outcome:
    """The outcome of one finished client call (see the module docstring). O(1)."""
    return replace(_kind(res), resent=res.resent)


def _kind(res: StreamResult) -> Outcome:
    if res.ok:
        return Outcome("completed", res.status)
    if res.status == "disconnected":
        return Outcome("disconnected", res.status, res.error)
    if res.rejected:
        if not res.error:
            return Outcome("lost", res.status, "an error status without a message")
        return Outcome("refused", res.status, res.error, retryable=int(res.status) in RETRYABLE)
    if res.status == "stream" and res.error_event:
        return Outcome("failed", res.status, res.error, retryable=True)
    if res.status == "connection" and res.started:
        return Outcome("cut", res.status, res.error, retryable=True)
    return Outcome("lost", res.status, res.error)


class Ledger:
    """Requests sent and their outcomes: ``send`` each request once, ``record`` its outcome
    once; ``report`` counts them. Raises ``ValueError`` on a second send or a second outcome
    of one request, or an outcome for a request never sent (a bug in the driver, not the server)."""

    def __init__(self) -> None:
        self._sent: set[Any] = set()
        self._outcomes: dict[Any, Outcome] = {}

    def send(self, key: Any) -> None:
        if key in self._sent:
            raise ValueError(f"request {key!r} sent twice")
        self._sent.add(key)

    def record(self, key: Any, outcome: Outcome) -> None:
        if key not in self._sent:
            raise ValueError(f"outcome for request {key!r}, which was never sent")
        if key in self._outcomes:
            raise ValueError(f"request {key!r} has an outcome already: {self._outcomes[key]}")
        self._outcomes[key] = outcome

    def report(self) -> dict[str, Any]:
        """Counts by kind (``lost`` includes the requests with no outcome), refusals by status,
        the retryable ones, the resent ones, and up to ``LOST_EXAMPLES`` lost requests with their status and
        message. O(requests)."""
        kinds = Counter(o.kind for o in self._outcomes.values())
        missing = [k for k in self._sent if k not in self._outcomes]
        lost = [(k, o) for k, o in self._outcomes.items() if o.kind == "lost"]
        examples = [{"request": str(k), "status": o.status, "message": o.message} for k, o in lost]
        examples += [{"request": str(k), "status": "", "message": "no outcome recorded"} for k in missing]
        return {
            "sent": len(self._sent),
            **{k: kinds.get(k, 0) for k in KINDS if k != "lost"},
            "lost": kinds.get("lost", 0) + len(missing),
            "refused_by_status": dict(sorted(Counter(o.status for o in self._outcomes.values()
                                                     if o.kind == "refused").items())),
            "retryable": sum(1 for o in self._outcomes.values() if o.retryable),
            "resent": sum(1 for o in self._outcomes.values() if o.resent),
            "lost_examples": examples[:LOST_EXAMPLES],
        }


def format_report(rep: dict[str, Any]) -> str:
    """One line for people: ``sent 100: completed 90, refused 6 (429: 6), failed 0, ...``."""
    refused = ", ".join(f"{s}: {n}" for s, n in rep["refused_by_status"].items())
    parts = [f"{k} {rep[k]}" + (f" ({refused})" if k == "refused" and refused else "") for k in KINDS]
    resent = f"; resent on a new connection {rep['resent']}" if rep.get("resent") else ""
    return f"sent {rep['sent']}: " + ", ".join(parts) + resent


__all__ = ["KINDS", "Ledger", "Outcome", "classify", "format_report"]
