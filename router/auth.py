"""API keys, tenants and the cache salt that keeps one tenant's prefixes from another's.

Why: a shared prefix cache is a timing side channel. If tenant B's request hits blocks that tenant
A's prompt left in the cache, B learns from its time to first token (and from ``cached_tokens``)
that A sent that prefix. With keys configured, every request belongs to the tenant its key maps
to, and the tenant's salt seeds the chain of block hashes (``fairway/hashing.py``) and goes to the
engine as vLLM's ``cache_salt``: equal prompts of two tenants share no block, in the router's view
and in the engine.

- Keys: ``Authorization: Bearer <key>``, from a file (``keys_file``: one ``<key> <tenant>`` per
  line, ``#`` comments) and/or an environment variable (``keys_env``: ``key=tenant,key=tenant``).
  A presented key is hashed (SHA-256) and looked up by digest, then the digests are compared in
  constant time (``hmac.compare_digest``), so neither the lookup nor the comparison times the
  key's bytes. Keys are never logged, and never leave this module: the rest of the ingress sees
  the tenant's name.
- Salts: ``tenant:<name>``; a request may instead use a named prefix group its tenant is allowed
  in (``prefix_groups``, configured per tenant; header ``X-Fairway-Prefix-Group``), salt
  ``group:<name>``, so tenants that share a system prompt on purpose share its cache. A client's
  own ``cache_salt`` nests under the tenant's salt (it can split a tenant's cache further, never
  join another tenant's).
- Without keys configured, nothing is checked and the client's ``cache_salt`` is used as is.

Complexity: one SHA-256 of the key and one dict probe per request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.openai_api import send_error

GROUP_HEADER = "x-fairway-prefix-group"


class TenantArgs(BaseModel):
    """One tenant's options."""

    model_config = ConfigDict(extra="forbid")

    prefix_groups: list[str] = Field(default_factory=list, description="named prefix groups this tenant may use")
    default_class: str = Field("", description="the request class of this tenant's requests that name none "
                                               "(default: the cluster's default class)")
    classes: list[str] = Field(default_factory=list, description="the request classes this tenant may use; a "
                               "request naming another gets 403 (empty: every class)")


class AuthArgs(BaseModel):
    """The ``auth`` key of the app's args. With neither ``keys_file`` nor ``keys_env``, auth is off."""

    model_config = ConfigDict(extra="forbid")

    keys_file: str | None = Field(None, description="file of '<key> <tenant>' lines")
    keys_env: str | None = Field(None, description="environment variable of 'key=tenant,...'")
    tenants: dict[str, TenantArgs] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.keys_file or self.keys_env)


class AuthError(Exception):
    """A request that may not proceed: ``status`` 401 (no or unknown key) or 403 (a prefix group
    its tenant may not use), with a message that names no key."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_NO_KEY = b"\xff" * 32  # compared against on a miss; no SHA-256 digest of a key in use equals it


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, sep: str) -> dict[str, str]:
    """``key<sep>tenant`` entries (one per line for a file, comma-separated for the environment)
    as key -> tenant. Raises ``ValueError`` naming the entry's position, never the key."""
    out: dict[str, str] = {}
    entries = text.splitlines() if sep == " " else text.split(",")
    for i, raw in enumerate(entries, 1):
        line = raw.split("#", 1)[0].strip() if sep == " " else raw.strip()
        if not line:
            continue
        parts = line.split(None, 1) if sep == " " else line.split("=", 1)
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"API key entry {i}: expected '<key>{sep}<tenant>'")
        out[parts[0].strip()] = parts[1].strip()
    return out


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: its tenant ("" without auth) and the salt its blocks hash under
    (None without auth)."""

    tenant: str
    base_salt: str | None

    def salt(self, client_salt: str | None) -> str | None:
        """The request's cache salt: the client's own nested under the tenant's (module docstring)."""
        if self.base_salt is None:
            return client_salt
        return f"{self.base_salt}|{client_salt}" if client_salt else self.base_salt


NO_AUTH = Principal("", None)


class KeyTable:
    """API key -> tenant, checked as the module docstring says."""

    def __init__(self, args: AuthArgs, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        keys: dict[str, str] = {}
        if args.keys_file:
            keys.update(parse_keys(Path(args.keys_file).read_text(), " "))
        if args.keys_env:
            if args.keys_env not in env:
                raise ValueError(f"auth.keys_env: environment variable {args.keys_env} is not set")
            keys.update(parse_keys(env[args.keys_env], "="))
        if args.enabled and not keys:
            raise ValueError("auth is configured but no API key was found")
        self.enabled = args.enabled
        self._by_digest = {_digest(k): (_digest(k), t) for k, t in keys.items()}
        self._groups = {t: set(a.prefix_groups) for t, a in args.tenants.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header value; ``AuthError`` 401 if missing or unknown."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthError(401, "missing API key: send 'Authorization: Bearer <key>'")
        d = _digest(authorization[7:].strip())
        stored, tenant = self._by_digest.get(d, (_NO_KEY, ""))
        if not hmac.compare_digest(d, stored):  # a hit and a miss take the same time
            raise AuthError(401, "invalid API key")
        return tenant

    def principal(self, authorization: str | None, group: str | None) -> Principal:
        """The request's tenant and base salt (see the module docstring); ``AuthError`` 401 / 403."""
        if not self.enabled:
            return NO_AUTH
        tenant = self.tenant_of(authorization)
        if group:
            if group not in self._groups.get(tenant, ()):
                raise AuthError(403, f"prefix group {group!r} is not open to this tenant")
            return Principal(tenant, f"group:{group}")
        return Principal(tenant, f"tenant:{tenant}")


#: The paths whose requests need a key: the API's, and vLLM's tokenizer routes (they cost CPU)
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class AuthGuard:
    """ASGI middleware: requests to ``KEYED_PATHS`` must carry a known key (401 before the body is read;
    403 for a prefix group the tenant may not use); the ``Principal`` goes to the handler in
    ``scope["state"]["principal"]``. ``keys`` is a ``KeyTable`` or a callable giving this
    replica's (its config is known only once it started)."""

    def __init__(self, app: Any, keys: KeyTable | Callable[[], KeyTable | None] | None = None,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self._keys = keys
        self._on_reject = on_reject  # gets "unauthorized" (401) or "forbidden" (403) per refusal

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        keys = self._keys() if callable(self._keys) else self._keys
        if (scope["type"] != "http" or keys is None or not keys.enabled
                or not scope.get("path", "").startswith(KEYED_PATHS)):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        try:
            principal = keys.principal(headers.get("authorization"), headers.get(GROUP_HEADER))
        except AuthError as e:
            if self._on_reject is not None:
                self._on_reject("unauthorized" if e.status == 401 else "forbidden")
            await send_error(send, e.status, e.message,
                             headers=[(b"www-authenticate", b"Bearer")] if e.status == 401 else ())
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


__all__ = ["GROUP_HEADER", "NO_AUTH", "AuthArgs", "AuthError", "AuthGuard", "KeyTable", "Principal", "TenantArgs",
           "parse_keys"]
