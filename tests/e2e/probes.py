"""Polling for the end-to-end tests (the replicas' gauges: ``observability/probe.py``): wait for a
condition with a deadline, never sleep and hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from observability.probe import router_outstanding

__all__ = ["poll", "routers_idle", "wait_routers_idle"]


def poll(fn: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2,
         describe: Callable[[], Any] | None = None) -> Any:
    """``fn()`` until it returns something true, or ``TimeoutError`` naming ``what`` and the last
    value (or ``describe()``, the state worth showing) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    if describe is not None:
        last = describe()
    raise TimeoutError(f"{what} not met after {timeout_s}s (last: {last!r})")


def routers_idle(url: str) -> bool:
    """Every request router listed at ``{url}/metrics/targets`` counts no request on any replica:
    each has seen the previous request complete, so none still counts it as queued. False while a
    listed router cannot be scraped (a killed ingress replica stays listed until its entry expires)."""
    try:
        routers, outstanding = router_outstanding(url)
    except OSError:
        return False
    return routers > 0 and outstanding == 0


def wait_routers_idle(url: str, timeout_s: float = 30.0) -> None:
    """Block until ``routers_idle(url)``; ``TimeoutError`` with the last count after ``timeout_s``.

    Why: the router learns that a request has left its replica from Ray's completion callback,
    which may come after the client has its answer. A follow-up sent at once can be ranked while
    the previous request still counts as queued on its replica, making an idle replica look as
    good as the holder of the prefix; the affinity checks wait for this before each follow-up."""

    def describe() -> object:
        try:
            return router_outstanding(url)
        except OSError as e:
            return e

    poll(lambda: routers_idle(url), timeout_s, "every router counting no request on any replica",
         interval_s=0.05, describe=describe)
