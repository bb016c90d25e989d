"""Cross-origin (CORS) access to the API from browsers, off unless origins are configured.

Why: a web application that calls the API from the browser (the ``openai`` JavaScript client
with ``dangerouslyAllowBrowser``, a chat playground) first sends an ``OPTIONS`` preflight with
no key, and reads an answer only if it names its origin. vLLM's server has the same settings
(``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``;
vllm-project/vllm, ``vllm/entrypoints/launchers/cli_args.py``: cross-origin access off by
default, methods and headers ``*``), applied by Starlette's ``CORSMiddleware``, as here.

``CorsGuard`` is ASGI middleware placed outside the key check, so a preflight is answered without
a key and a 401 still carries the origin's header. Its settings are the ingress's (known once
its replica is constructed), read per request; the Starlette middleware is built once for that
settings object. O(1) per request beyond Starlette's own header checks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.middleware.cors import CORSMiddleware

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class CorsArgs(BaseModel):
    """The ``cors`` key of the app's args (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_origins: tuple[str, ...] = Field((), description="origins whose browsers may call the API "
                                             "(\"*\": any); none: cross-origin access is off")
    allow_credentials: bool = Field(False, description="whether a cross-origin request may carry cookies or "
                                    "HTTP authentication (not with \"*\" as the origin)")
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


class CorsGuard:
    """ASGI middleware: Starlette's ``CORSMiddleware`` with the ingress's ``CorsArgs``, or a pass
    through while no origin is allowed (module docstring)."""

    def __init__(self, app: ASGIApp, cors: Callable[[], CorsArgs]) -> None:
        self.app = app
        self._cors = cors
        self._built: tuple[CorsArgs, CORSMiddleware] | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        args = self._cors()
        if scope["type"] != "http" or not args.allowed_origins:
            await self.app(scope, receive, send)
            return
        if self._built is None or self._built[0] is not args:  # the ingress's own settings object
            self._built = (args, CORSMiddleware(self.app, allow_origins=args.allowed_origins,
                                                allow_credentials=args.allow_credentials,
                                                allow_methods=args.allowed_methods,
                                                allow_headers=args.allowed_headers))
        await self._built[1](scope, receive, send)


__all__ = ["CorsArgs", "CorsGuard"]
