"""Render each dashboard's main panels to a PNG from recorded Prometheus data (no Grafana).

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --out out/dashboards/

Runs every query of the main panels (``dashboards/queries.py``, the same expressions as the
Grafana JSON) through ``query_range`` and draws them with matplotlib, one PNG per dashboard
(``<out>/fairway-overview.png``, ``<out>/fairway-replicas.png``). The time range defaults to
the span in which Prometheus holds Fairway data within ``--lookback`` (default 24 h); give
``--start`` / ``--end`` (unix seconds) or ``--last 15m`` to pin it. ``$__rate_interval`` becomes
Grafana's ``max(step + scrape, 4 * scrape)``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from dashboards.prom import PromClient
from dashboards.queries import DASHBOARDS, Panel, dashboard_panels, panel_queries, promql

PRESENCE_QUERY = "sum(fairway_ttft_seconds_count) or sum(fairway_requests_total) or sum(fairway_queue_depth)"


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '1d' or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def rate_interval(step: float, scrape_s: float) -> str:
    """Grafana's ``$__rate_interval`` for this step: max(step + scrape, 4 x scrape)."""
    return f"{max(step + scrape_s, 4 * scrape_s):.0f}s"


def data_span(client: PromClient, lookback_s: float, now: float | None = None) -> tuple[float, float] | None:
    """First and last time within the lookback at which Prometheus has any Fairway series."""
    now = time.time() if now is None else now
    start = now - lookback_s
    step = max(1.0, math.ceil(lookback_s / 10000))
    res = client.query_range(PRESENCE_QUERY, start, now, step)
    ts = [float(t) for s in res for t, _ in s["values"]]
    if not ts:
        return None
    return min(ts), max(ts)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def fetch_panel(client: PromClient, panel: Panel, start: float, end: float, step: float, scrape_s: float) -> list:
    """[(label, [t...], [v...], ref)] for every series of every query of ``panel``."""
    out = []
    for q in panel_queries(panel.key):
        expr = promql(q.expr, rate_interval(step, scrape_s))
        for s in client.query_range(expr, start, end, step):
            pts = [(float(t), float(v)) for t, v in s["values"]]
            pts = [(t, v) for t, v in pts if math.isfinite(v)]
            if pts:
                out.append((legend(q.legend, s["metric"]), [t for t, _ in pts], [v for _, v in pts], q.ref))
    out.sort(key=lambda x: (x[0], x[3]))
    return out


def _scale(unit: str) -> tuple[float, str]:
    return {
        "percentunit": (100.0, "%"),
        "s": (1.0, "seconds"),
        "reqps": (1.0, "req/s"),
        "ops": (1.0, "1/s"),
        "short": (1.0, ""),
    }.get(unit, (1.0, unit))


def draw(
    title: str, panels: list[Panel], data: list[list], start: float, end: float, out_path: Path, note: str = ""
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.6 * rows), squeeze=False)
    t0, t1 = datetime.fromtimestamp(start), datetime.fromtimestamp(end)
    for i, (panel, series) in enumerate(zip(panels, data, strict=True)):
        ax = axes[i // cols][i % cols]
        k, ylabel = _scale(panel.unit)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel(ylabel, fontsize=8)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif panel.stack == "percent":
            maps = [dict(zip(ts, vs, strict=True)) for _, ts, vs, _ in series]
            # only the instants with traffic: no ramp from an empty start into the first share
            grid = sorted(t for t in {t for m in maps for t in m} if sum(m.get(t, 0.0) for m in maps) > 0)
            vals = [[m.get(t, 0.0) for t in grid] for m in maps]
            tot = [sum(c) or 1.0 for c in zip(*vals, strict=True)]
            shares = [[100.0 * v / s for v, s in zip(row, tot, strict=True)] for row in vals]
            ax.stackplot([datetime.fromtimestamp(t) for t in grid], shares, labels=[s[0] for s in series], alpha=0.8)
            ax.set_ylabel("% of requests", fontsize=8)
            ax.set_ylim(0, 100)
        else:
            # one colour per series group (the legend without its last word when queries differ
            # only by quantile, e.g. "fast p50" / "fast p90"), one line style per query
            refs = sorted({ref for *_, ref in series})
            groups: dict[str, int] = {}
            for label, ts, vs, ref in series:
                group = label.rsplit(" ", 1)[0] if len(refs) > 1 else label
                color = f"C{groups.setdefault(group, len(groups)) % 10}"
                style = ("-", "--", ":", "-.")[refs.index(ref) % 4]
                xs = [datetime.fromtimestamp(t) for t in ts]
                ax.plot(xs, [k * v for v in vs], label=label, lw=1.2, color=color, linestyle=style)
            ax.set_ylim(bottom=0)
        ax.set_xlim(t0, t1)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if len(series) > 6 else 1, framealpha=0.6)
    for j in range(len(panels), rows * cols):
        axes[j // cols][j % cols].axis("off")
    span = f"{t0:%Y-%m-%d %H:%M:%S} - {t1:%H:%M:%S}"
    fig.suptitle(f"{title}   ({span}{'; ' + note if note else ''})", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=90)
    plt.close(fig)


def render_all(
    client: PromClient,
    out_dir: Path,
    start: float,
    end: float,
    step: float | None = None,
    scrape_s: float = 2.0,
    all_panels: bool = False,
    note: str = "",
) -> dict[str, Any]:
    """Write one PNG per dashboard; returns {dashboard: {"path", "panels", "empty"}}."""
    step = step or max(scrape_s, math.ceil((end - start) / 300))
    report: dict[str, Any] = {}
    for name, meta in DASHBOARDS.items():
        panels = [p for p in dashboard_panels(name) if p.main or all_panels]
        data = [fetch_panel(client, p, start, end, step, scrape_s) for p in panels]
        path = out_dir / f"{meta['uid']}.png"
        draw(meta["title"], panels, data, start, end, path, note)
        report[name] = {
            "path": str(path),
            "panels": len(panels),
            "empty": [p.key for p, d in zip(panels, data, strict=True) if not d],
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.render", description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    ap.add_argument("--out", type=Path, default=Path("out/dashboards"), help="output directory")
    ap.add_argument("--start", type=float, help="range start (unix seconds)")
    ap.add_argument("--end", type=float, help="range end (unix seconds)")
    ap.add_argument("--last", type=parse_duration, help="range = the last DURATION (e.g. 15m)")
    ap.add_argument("--lookback", type=parse_duration, default=86400.0, help="auto range search window (24h)")
    ap.add_argument("--step", type=parse_duration, help="query_range step (default: range / 300, >= scrape)")
    ap.add_argument("--scrape-interval", type=parse_duration, default=2.0, help="Prometheus scrape interval (2s)")
    ap.add_argument("--all-panels", action="store_true", help="draw every timeseries panel, not only main ones")
    args = ap.parse_args(argv)

    client = PromClient(args.prometheus)
    now = time.time()
    if args.last:
        start, end = now - args.last, now
    elif args.start is not None:
        start, end = args.start, args.end if args.end is not None else now
    else:
        span = data_span(client, args.lookback, now)
        if span is None:
            print(f"no Fairway data in {args.prometheus} in the last {args.lookback:g}s", file=sys.stderr)
            return 1
        start, end = span
        if end - start < 60:  # pad very short runs so the plot is readable
            start -= (60 - (end - start)) / 2
            end = start + 60
    report = render_all(client, args.out, start, end, args.step, args.scrape_interval, args.all_panels)
    for name, r in report.items():
        empty = f" (no data: {', '.join(r['empty'])})" if r["empty"] else ""
        print(f"{name}: {r['path']} [{r['panels']} panels]{empty}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
