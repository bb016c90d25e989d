"""The shared routing view across ingress replicas: one Ray actor holding a ``ViewLog``.

Every ``FairwayRequestRouter`` of an application finds the same named actor (created by the
first one, ``get_if_exists``; detached, so it outlives the ingress replica that created it and a
restarted router finds the log intact) and calls ``exchange`` every ``sync_period_s``: one actor
call carries its batch of events out and the other routers' events in. A router silent for
``ttl_s`` (3 s; a live one exchanges every 10 ms) is announced gone, and the others drop the
requests it had in flight. Why an actor: it is what
Ray gives for shared state (Ray's own prefix-aware router keeps its tree in one), it needs no
broker or port of ours, and one round trip per period per router costs far less than a decision.
"""

from __future__ import annotations

import time
from typing import Any

from fairway.routing.view_log import Event, Exchange, ViewLog

NAMESPACE = "fairway"


class ViewHub:
    """The actor's class: a ``ViewLog`` behind ``exchange`` (see ``fairway/routing/view_log.py``)."""

    def __init__(self, capacity: int = 200_000, ttl_s: float = 3.0) -> None:
        self.log = ViewLog(capacity, ttl_s)

    def exchange(self, source: str, events: list[Event], after: int) -> Exchange:
        return self.log.exchange(source, events, after, time.monotonic())


def hub_name(app_name: str) -> str:
    return f"fairway-view-{app_name or 'default'}"


def get_hub(app_name: str, capacity: int = 200_000) -> Any:
    """The application's hub actor, created if it does not exist yet."""
    import ray

    return ray.remote(ViewHub).options(
        name=hub_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1).remote(capacity)
