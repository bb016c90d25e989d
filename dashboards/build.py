"""Generate the Grafana 11 dashboards (JSON) from ``dashboards/queries.py``.

    python -m dashboards.build            # write dashboards/json/*.json
    python -m dashboards.build --check    # exit 1 if the committed JSON differs from the code

Plain Python (no dashboards-as-code dependency): a dashboard is a dict in Grafana's JSON model
(schemaVersion 39, Grafana 11). Panels use a ``datasource`` template variable (default: the
provisioned "Fairway Prometheus", uid ``fairway-prometheus``, ``deploy/grafana/``), so the JSON
also imports into a Grafana with another Prometheus datasource. Output is deterministic
(sorted keys, fixed ids), which is what makes ``--check`` meaningful.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from dashboards.queries import DASHBOARDS, Panel, dashboard_panels, panel_queries

JSON_DIR = Path(__file__).resolve().parent / "json"
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _timeseries_defaults(panel: Panel) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
        "axisSoftMin": 0,
        "stacking": {"mode": panel.stack or "none", "group": "A"},
    }
    if panel.stack:
        custom["fillOpacity"] = 60
    return {"unit": panel.unit, "min": 0, "custom": custom}


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {
            "refId": q.ref,
            "datasource": DATASOURCE,
            "expr": q.expr,
            "legendFormat": q.legend,
            "range": True,
            "editorMode": "code",
        }
        for q in panel_queries(panel.key)
    ]
    if not targets:
        raise ValueError(f"panel {panel.key!r} has no queries")
    out: dict[str, Any] = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": panel.w, "h": panel.h},
        "targets": targets,
    }
    if panel.kind == "timeseries":
        out["fieldConfig"] = {"defaults": _timeseries_defaults(panel), "overrides": []}
        out["options"] = {
            "legend": {"displayMode": "table", "placement": "right", "showLegend": True, "calcs": ["lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        out["fieldConfig"] = {
            "defaults": {"unit": panel.unit, "decimals": 2, "color": {"mode": "thresholds"}},
            "overrides": [],
        }
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        raise ValueError(f"unknown panel kind {panel.kind!r}")
    return out


def build_dashboard(name: str) -> dict[str, Any]:
    """The Grafana JSON model of dashboard ``name`` (a key of ``DASHBOARDS``)."""
    meta = DASHBOARDS[name]
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    row, x, row_h = None, 0, 0
    for p in dashboard_panels(name):
        if p.row != row or x + p.w > 24:
            y += row_h
            x, row_h = 0, 0
        if p.row != row:
            panels.append(
                {
                    "id": pid,
                    "type": "row",
                    "title": p.row,
                    "collapsed": False,
                    "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                    "panels": [],
                }
            )
            pid += 1
            y += 1
            row = p.row
        panels.append(_panel_json(p, pid, x, y))
        pid += 1
        x += p.w
        row_h = max(row_h, p.h)
    return {
        "uid": meta["uid"],
        "title": meta["title"],
        "description": meta["description"],
        "tags": ["fairway"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": []},
        "links": [
            {
                "title": "Fairway dashboards",
                "type": "dashboards",
                "tags": ["fairway"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Fairway Prometheus", "value": "fairway-prometheus"},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "includeAll": False,
                    "multi": False,
                    "options": [],
                }
            ]
        },
        "panels": panels,
    }


def render_json(name: str) -> str:
    """Deterministic text of dashboard ``name`` (what is committed)."""
    return json.dumps(build_dashboard(name), indent=2, sort_keys=True) + "\n"


def json_path(name: str, out_dir: Path = JSON_DIR) -> Path:
    return out_dir / f"{DASHBOARDS[name]['uid']}.json"


def check(out_dir: Path = JSON_DIR) -> list[str]:
    """Problems: committed files that are missing, differ from the code, or are stale extras."""
    problems = []
    expected = {json_path(n, out_dir).name for n in DASHBOARDS}
    for name in DASHBOARDS:
        path = json_path(name, out_dir)
        want = render_json(name)
        if not path.exists():
            problems.append(f"{path}: missing (run python -m dashboards.build)")
            continue
        have = path.read_text()
        if have != want:
            lines = difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(path), "generated", n=1)
            diff = "".join(list(lines)[:40])
            problems.append(f"{path}: differs from the generated JSON (run python -m dashboards.build)\n{diff}")
    if out_dir.exists():
        for extra in sorted(p.name for p in out_dir.glob("*.json")):
            if extra not in expected:
                problems.append(f"{out_dir / extra}: not generated by dashboards/build.py")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare the committed JSON with the code; exit 1 if stale")
    ap.add_argument("--out", type=Path, default=JSON_DIR, help="output directory (default dashboards/json)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            return 1
        print(f"dashboards up to date: {', '.join(sorted(json_path(n, args.out).name for n in DASHBOARDS))}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in DASHBOARDS:
        path = json_path(name, args.out)
        path.write_text(render_json(name))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
