"""The ingress's answers other than 200, and how a replica's or Ray's failure maps onto them.

Errors are mapped, never swallowed: a full replica queue is 429 with Retry-After (naming the
replica, so the request may be tried once elsewhere), Ray's own back-pressure or a dead or
unavailable replica is 503 with Retry-After, a request the engine can never hold is 400, a
parameter an engine cannot honour is 400 naming it.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from fairway.protocol import Overloaded, PastWaitBound, ReplicaError, UnsupportedParameter
from router.openai_api import error_body

logger = logging.getLogger("ray.serve")


class HTTPError(Exception):
    """An answer other than 200. ``refused_by``: the replica whose gate refused the request before
    its engine saw it (429, queue full), so it may be tried once on another replica."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, reason: str = "",
                 param: str | None = None, refused_by: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.param = param
        self.refused_by = refused_by

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after_s))))
        return JSONResponse(error_body(self.message, self.status, self.param), status_code=self.status,
                            headers=headers)


def map_error(e: BaseException) -> HTTPError:
    """A replica or Ray failure as the HTTP error the client gets."""
    cause = getattr(e, "cause", None)
    for x in (e, cause):
        if isinstance(x, UnsupportedParameter):
            return HTTPError(400, x.message, None, "unsupported_parameter", x.param)
        if isinstance(x, PastWaitBound):
            return HTTPError(429, x.message, x.retry_after_s, "past_bound")
        if isinstance(x, ReplicaError):
            reason = {429: "queue_full", 400: "too_long", 504: "stalled"}.get(x.status, "engine_failed")
            return HTTPError(x.status, x.message, x.retry_after_s if x.status in (429, 503) else None, reason,
                             refused_by=x.replica if isinstance(x, Overloaded) else "")
    name = type(e).__name__
    if name == "BackPressureError":
        return HTTPError(503, "the cluster is overloaded: too many requests queued; retry later", 1.0, "overloaded")
    if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "DeploymentUnavailableError"):
        return HTTPError(503, f"replica unavailable ({name}); retry", 1.0, "replica_dead")
    if isinstance(e, TimeoutError):
        return HTTPError(503, "request timed out in the cluster; retry", 1.0, "timeout")
    logger.exception("ingress: unexpected error", exc_info=e)
    return HTTPError(500, f"internal error: {name}: {e}", None, "internal")
