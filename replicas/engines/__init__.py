"""Engines behind the replica gate: an open registry of names (docs/design.md, Open registry).

``make_engine("vllm", model=..., block_size=16, ...)`` builds a registered engine; a dotted path
(``my.module:MyEngine``) imports any class; ``validated_engine`` checks options where a config is
parsed. Entries are dotted paths resolved on first use, so
importing this package never imports an engine's heavy dependencies (vLLM, torch).
"""

from __future__ import annotations

from typing import Any

from fairway.protocol import Engine
from fairway.registry import resolve_class

# name -> "module:Class"; one line per engine.
ENGINES: dict[str, str] = {
    "sim": "replicas.engines.sim_engine:SimEngine",
    "vllm": "replicas.engines.vllm_engine:VllmEngine",
}


class EngineError(ValueError):
    """An unknown engine kind, a failed import, or bad engine options."""


def engine_class(kind: str) -> type[Engine]:
    """The class registered as ``kind``, or imported from ``module:Class`` / ``module.Class``: a
    ``fairway.protocol.Engine`` subclass (``EngineError`` otherwise)."""
    path = ENGINES.get(kind, kind)
    if ":" not in path and "." not in path:
        raise EngineError(f"unknown engine {kind!r}; known: {', '.join(sorted(ENGINES))}")
    return resolve_class(path, {}, Engine, "engine", EngineError)


def make_engine(kind: str, **kwargs: Any) -> Engine:
    """Build an engine; ``start()`` is the caller's."""
    cls = engine_class(kind)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise EngineError(f"bad options for engine {kind!r}: {e}") from e


def validated_engine(kind: str, options: dict[str, Any]) -> Engine:
    """Check ``kind`` and its ``options`` by building the engine once, unstarted (cheap: an
    engine loads its model in ``start()``), and return it, for what the config reads of it (its
    step budget): ``EngineError`` naming the engine and the option on an unknown kind, an unknown
    option or a bad value. For config boundaries (``serve run``), so a typo fails there and not in
    a running replica, as ``validated_policy`` does for policies."""
    try:
        return make_engine(kind, **options)
    except ValueError as e:
        if isinstance(e, EngineError):
            raise
        raise EngineError(f"bad options for engine {kind!r}: {e}") from e


__all__ = ["ENGINES", "EngineError", "engine_class", "make_engine", "validated_engine"]
