"""Policy specs: the one syntax that names a policy and its options, on the command line and in YAML.

A spec is ``name`` or ``name[key=value;key=value]``, e.g. ``fairway[theta=4;fair_share=0.5]``;
values are JSON where they parse as JSON (numbers, booleans, quoted strings), else plain strings.
``resolve_spec`` merges a spec's bracket options with options given beside it (YAML's
``policy_options``); naming one key in both places is an error, not a silent override.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class SpecError(ValueError):
    """A malformed policy spec, or an option given twice."""


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``fairway`` or ``fairway[theta=4;fair_share=0.5]`` -> (name, options). O(len(spec))."""
    spec = spec.strip()
    if "[" not in spec:
        return spec, {}
    if not spec.endswith("]"):
        raise SpecError(f"malformed policy spec {spec!r}: expected name[key=value;...]")
    name, _, body = spec[:-1].partition("[")
    opts: dict[str, Any] = {}
    for part in filter(None, body.split(";")):
        if "=" not in part:
            raise SpecError(f"malformed policy option {part!r} in {spec!r}: expected key=value")
        k, _, v = part.partition("=")
        opts[k.strip()] = _value(v.strip())
    return name.strip(), opts


def _value(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def resolve_spec(spec: str, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The policy name and all its options: the spec's bracket options plus ``options``."""
    name, opts = parse_spec(spec)
    for k, v in (options or {}).items():
        if k in opts:
            raise SpecError(f"option {k!r} of {name!r} is given twice: in {spec!r} and beside it")
        opts[k] = v
    return name, opts


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs on the commas outside brackets. O(len(text))."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]
