"""Name -> class resolution shared by the open registries (queue policies, router policies).

A registry accepts a registered name or a dotted class path (``module:Class`` or
``module.Class``), the way Ray's ``request_router_class`` does, so a new policy needs no edit to a
factory (docs/design.md, Open registry).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from fairway.spec import SpecError, resolve_spec


def resolve_class(name: str, registry: Mapping[str, type], base: type, kind: str, error: type[Exception]) -> type:
    """The class registered as ``name``, or imported from a dotted path; ``error`` (with
    ``kind``, e.g. "policy", in its message) for unknown names, failed imports and classes that
    are not ``base`` subclasses. O(1) for registered names."""
    if name in registry:
        return registry[name]
    if ":" in name or "." in name:
        mod, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise error(f"cannot import {kind} class {name!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise error(f"{name!r} is not a {base.__name__} subclass")
        return cls
    known = ", ".join(sorted(registry))
    raise error(f"unknown {kind} {name!r}; known: {known}")


def checked_spec(spec: str, options: Mapping[str, Any] | None, build: Callable[..., object],
                 error: type[Exception]) -> tuple[str, dict[str, Any]]:
    """``spec`` plus ``options`` as (name, options), checked by calling ``build(name, **options)``
    once; a malformed spec or an option given twice raises ``error`` too. For config boundaries
    (YAML, command line), so a typo fails there and not in a running replica."""
    try:
        name, opts = resolve_spec(spec, options)
    except SpecError as e:
        raise error(str(e)) from e
    build(name, **opts)
    return name, opts
