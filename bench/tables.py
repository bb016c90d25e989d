"""Markdown tables and the report: ``report`` turns a folder of the benchmarks' JSON files into ``tables.md``.

Apart from the running code so that the tables can be rebuilt from saved JSON
(``python -m bench.cluster report``) and tested without a cluster. ``code_versions`` warns when the
runs in a folder used different code (their recorded fingerprints differ).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.recording import SIM_ROUTERS, _sim_router

# -- tables ---------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def md_table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column (``l`` or ``r``; default: first
    column left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    seps = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(seps) + " |"]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def overhead_table(res: dict[str, Any]) -> str:
    """Markdown: per-path latency, the differences, and the decision times."""
    paths = res["paths_ms"]
    rows = [[p, d["p50"], d["p90"], d["p99"], d["mean"], d["n"]] for p, d in paths.items() if d["n"]]
    extra = res.get("extra_ms", {})
    names = {"ingress_ttft": "ingress-measured TTFT (http path)",
             "replica_ttft_http": "replica-measured TTFT (http path)",
             "replica_ttft_handle": "replica-measured TTFT (handle path)"}
    rows += [[names.get(k, k), d["p50"], d["p90"], d["p99"], d["mean"], d["n"]] for k, d in extra.items()]
    out = [md_table(["path (client-timed unless noted)", "p50 ms", "p90 ms", "p99 ms", "mean ms", "n"], rows)]
    drows = [[k, d["p50_of_diff_ms"], d["diff_of_p50_ms"], d["diff_of_p99_ms"], d["paired"]["p99"]]
             for k, d in res.get("diffs", {}).items()]
    if drows:
        out.append(md_table(["difference", "median paired ms", "p50 diff ms", "p99 diff ms", "paired p99 ms"],
                            drows))
    dec = res.get("decision_us")
    rrows = []
    if dec:
        rrows.append(["in cluster (driver's FairwayRequestRouter)", "2", res.get("prompt_tokens", 8192),
                      dec["p50"], dec["p99"], dec["n"]])
    for o in res.get("offline_routing", []):
        rrows.append([f"offline `bench.routing` {o['router']}", str(o["replicas"]), o["prompt_tokens"],
                      o["p50_us"], o["p99_us"], "2000"])
    if rrows:
        out.append(md_table(["routing decision", "replicas", "prompt tokens", "p50 us", "p99 us", "n"], rrows))
    cpu = res.get("ingress_cpu_ms")
    if cpu:
        crows = [[k, d["p50"], d["p99"]] for k, d in cpu.items()]
        crows.append(["sum of p50s", sum(d["p50"] for d in cpu.values()), ""])
        out.append(md_table([f"ingress CPU per request, {res.get('prompt_tokens', 8192)} tokens (offline)",
                             "p50 ms", "p99 ms"], crows))
    if res.get("errors"):
        out.append("errors: " + "; ".join(f"{k}: {v}" for k, v in res["errors"].items()))
    return "\n\n".join(out)


def _lanes(res: dict[str, Any]) -> str:
    lanes = res.get("ttft_by_lane_s") or {}
    return " ".join(f"{k} {v['p50']:.3f}/{v['p99']:.3f} (n={v['n']})" for k, v in lanes.items()) or "-"


def _split(res: dict[str, Any]) -> str:
    per = res.get("per_replica") or []
    return "/".join(str(p["requests"]) for p in per) or "-"


def _loadavg(res: dict[str, Any]) -> str:
    la = res.get("loadavg")
    return f"{la[0]:.1f}/{la[1]:.1f}" if la else "-"


def sim_vs_real_table(sim: dict[str, Any], reals: dict[str, dict[str, Any]],
                      engines: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """Markdown: sim row, one row per real run, and real/sim ratio rows."""
    t = sim["ttft_s"]
    rows: list[list[Any]] = [["sim", t["p50"], t["p90"], t["p99"], t["mean"], sim["cache_hit_ratio"], sim["n_finished"],
                              _lanes(sim), _split(sim)]]
    for name, res in reals.items():
        r = res["ttft_s"]
        rows.append([f"real ({name})", r["p50"], r["p90"], r["p99"], r["mean"], res["cache_hit_ratio"],
                     res["n_finished"], _lanes(res), _split(res)])
    for name, res in reals.items():
        r = res["ttft_s"]
        rows.append([f"real/sim ({name})", ratio(r["p50"], t["p50"]), ratio(r["p90"], t["p90"]),
                     ratio(r["p99"], t["p99"]), ratio(r["mean"], t["mean"]),
                     ratio(res["cache_hit_ratio"], sim["cache_hit_ratio"]), "", "", ""])
    out = [md_table(["run", "p50 s", "p90 s", "p99 s", "mean s", "hit", "n", "lanes p50/p99 s", "split"], rows)]
    erows: list[list[Any]] = []
    for name in reals:
        for e in (engines or {}).get(name, []):
            tm = e.get("timing") or {}
            erows.append([name, str(e.get("replica", "?"))[-8:], tm.get("modelled_busy_s"), tm.get("wall_busy_s"),
                          tm.get("slowdown"), tm.get("late_ms_p50"), tm.get("late_ms_p99"), tm.get("written_off_s")])
    if erows:
        out.append(md_table(["real run", "replica", "modelled busy s", "wall busy s", "wall/modelled",
                             "late p50 ms", "late p99 ms", "written off s"], erows))
    split_rows: list[list[Any]] = []
    for name, res in reals.items():
        sv, cl = res.get("server_ttft_s"), res.get("client_side_s")
        if sv:
            split_rows.append([f"ingress-measured TTFT ({name})", sv["p50"], sv["p90"], sv["p99"], sv["mean"]])
            split_rows.append([f"ingress-measured / sim ({name})",
                               *(ratio(sv[k], t[k]) for k in ("p50", "p90", "p99", "mean"))])
        if cl:
            split_rows.append([f"client side = client - ingress TTFT ({name})",
                               *(cl[k] for k in ("p50", "p90", "p99", "mean"))])
    if split_rows:
        out.append(md_table(["TTFT split", "p50 s", "p90 s", "p99 s", "mean s"], split_rows))
    crows = [[name, (res.get("send_lag_s") or {}).get("p99", 0.0) * 1e3, (res.get("itl_s") or {}).get("p50", 0.0) * 1e3,
              (res.get("e2e_s") or {}).get("p50"), res.get("n_rejected"), res.get("n_unfinished"),
              " ".join(res.get("foreign_replicas") or []) or "none", _loadavg(res)]
             for name, res in reals.items()]
    out.append(md_table(["real run", "send lag p99 ms", "ITL p50 ms", "E2E p50 s", "rejected", "unfinished",
                         "foreign replicas", "load avg start/end"], crows))
    return "\n\n".join(out)


def routers_table(reals: dict[str, dict[str, Any]], sims: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per router on the cluster, then the simulator's rows."""
    rows: list[list[Any]] = []
    for label, group in (("cluster", reals), ("sim", sims)):
        for name, res in group.items():
            t = res["ttft_s"]
            ex = (res.get("ttft_by_class_s") or {}).get("expensive", {})
            errs = res.get("errors_by_status") or {}
            rows.append([f"{name} ({label})", t["p50"], t["p90"], t["p99"], ex.get("p99"), _lanes(res),
                         res["cache_hit_ratio"], _split(res), f"{res['n_finished']}/{res['n_requests']}",
                         " ".join(f"{k}:{v}" for k, v in errs.items()) or "-", _loadavg(res)])
    return md_table(["router", "p50 s", "p90 s", "p99 s", "expensive p99 s", "lanes p50/p99 s", "hit",
                     "per-replica requests", "ok/sent", "errors", "load avg start/end"], rows)


def sim_requests(workload: str, rate: float, duration: float, seed: int, router: str = "fairway",
                 replicas: int = 2, kv_blocks: int = 20000,
                 router_options: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """The simulator's finished requests of that run, by rid: TTFT, kind, prompt and cached tokens."""
    from sim.runner import RunConfig, build

    sim, _ = build(RunConfig(workload=workload, policy="fairway", rate=rate, duration_s=duration, seed=seed,
                             replicas=replicas, router=router, router_options=router_options or {},
                             kv_blocks=kv_blocks))
    res = sim.run()
    return {r.spec.rid: {"ttft_s": r.ttft_s, "kind": r.spec.kind, "prompt_tokens": r.spec.prompt_tokens,
                         "cached_tokens": max(0, r.cached_tokens), "replica": r.replica} for r in res.finished}


def pairs_table(reals: dict[str, dict[str, Any]], sim: dict[int, dict[str, Any]], top: int = 3) -> str:
    """Markdown: per real run, the per-request differences real - sim (client and ingress TTFT)
    by request kind, and the slowest requests of the real run next to their simulated TTFT."""
    import numpy as np

    rows: list[list[Any]] = []
    slow: list[list[Any]] = []
    for name, res in reals.items():
        reqs = [q for q in res.get("requests") or [] if q["rid"] in sim and q["ttft_s"] is not None]
        if not reqs:
            continue
        for kind in sorted({q["kind"] for q in reqs}):
            g = [q for q in reqs if q["kind"] == kind]
            d = np.array([q["ttft_s"] - sim[q["rid"]]["ttft_s"] for q in g])
            ds = np.array([q["server_ttft_s"] - sim[q["rid"]]["ttft_s"] for q in g if q["server_ttft_s"] is not None])
            same_hit = np.mean([(q["cached_tokens"] or 0) == sim[q["rid"]]["cached_tokens"] for q in g])
            rows.append([name, kind, len(g), float(np.median(d)) * 1e3, float(np.percentile(d, 90)) * 1e3,
                         float(np.median(ds)) * 1e3 if ds.size else None,
                         float(np.percentile(ds, 90)) * 1e3 if ds.size else None, float(same_hit)])
        for q in sorted(reqs, key=lambda q: -q["ttft_s"])[:top]:
            sq = sim[q["rid"]]
            slow.append([name, q["rid"], q["kind"], q["prompt_tokens"], f"{q['cached_tokens']}/{sq['cached_tokens']}",
                         q["ttft_s"], q["server_ttft_s"], sq["ttft_s"]])
    if not rows:
        return ""
    return "\n\n".join([
        md_table(["real run", "kind", "n", "real - sim p50 ms", "p90 ms", "ingress - sim p50 ms", "p90 ms",
                  "same cached tokens"], rows),
        md_table(["real run", "slowest rids", "kind", "prompt", "cached real/sim", "real TTFT s", "ingress TTFT s",
                  "sim TTFT s"], slow)])


def routers_median_table(runs: dict[str, dict[str, Any]], policies: list[str]) -> str:
    """Markdown: per policy, the median over its repeated runs (tags ``policy-rK``)."""
    import numpy as np

    rows: list[list[Any]] = []
    for p in policies:
        group = [v for k, v in runs.items() if k == p or k.rsplit("-r", 1)[0] == p]
        if not group:
            continue

        def med(f: Any, g: list[dict[str, Any]] = group) -> float:
            return float(np.median([f(x) for x in g]))

        rows.append([p, len(group), med(lambda x: x["ttft_s"]["p50"]), med(lambda x: x["ttft_s"]["p90"]),
                     med(lambda x: x["ttft_s"]["p99"]), med(lambda x: x["ttft_s"]["mean"]),
                     med(lambda x: x["cache_hit_ratio"]),
                     med(lambda x: (x.get("server_ttft_s") or x["ttft_s"])["p50"]),
                     med(lambda x: (x.get("server_ttft_s") or x["ttft_s"])["p99"])])
    return md_table(["router (median over runs)", "runs", "p50 s", "p90 s", "p99 s", "mean s", "hit",
                     "ingress p50 s", "ingress p99 s"], rows)


# -- the report -----------------------------------------------------------------------------------


def code_versions(out: Path) -> str:
    """One line: which code fingerprints the runs in ``out`` used (a warning if more than one, or
    if the tree changed during a run)."""
    seen: dict[str, list[str]] = {}
    changed = []
    for p in sorted(out.glob("*.json")):
        d = _load(p)
        if isinstance(d, dict) and d.get("code"):
            seen.setdefault(d["code"], []).append(p.stem)
            if d.get("code_at_end") and d["code_at_end"] != d["code"]:
                changed.append(p.stem)
    if not seen:
        return "code fingerprint: not recorded"
    if len(seen) == 1 and not changed:
        return f"code fingerprint (`bench.recording.code_fingerprint`): {next(iter(seen))} for every run"
    lines = [f"WARNING: runs used different code ({len(seen)} fingerprints):"]
    lines += [f"- {k}: {', '.join(v)}" for k, v in seen.items()]
    files = {d["code"]: d.get("code_files") for d in (_load(p) for p in sorted(out.glob("*.json")))
             if isinstance(d, dict) and d.get("code") and d.get("code_files")}
    if len(files) > 1:
        first, *rest = files.values()
        diff = sorted({k for f in rest for k in set(first) | set(f) if first.get(k) != f.get(k)})
        lines.append(f"- files that differ: {', '.join(diff)}")
    if changed:
        lines.append(f"- the tree changed during: {', '.join(changed)}")
    return "\n".join(lines)


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def report(out: Path) -> str:
    """``tables.md`` for the JSON files in ``out`` (missing parts are skipped)."""
    parts: list[str] = []
    ov = _load(out / "overhead.json")
    if ov:
        parts += ["### Router overhead", overhead_table(ov)]
    sim = _load(out / "simreal-sim.json")
    meta = _load(out / "simreal-meta.json") or {}
    tags = meta.get("runs") or []
    reals = {t: _load(out / f"simreal-real-{t}.json") for t in tags}
    reals = {k: v for k, v in reals.items() if v}
    if sim and reals:
        engines = {k: _load(out / f"simreal-real-{k}-engine.json") or [] for k in reals}
        head = {k: meta[k] for k in ("workload", "rate", "duration_s", "seed") if k in meta}
        parts += [f"### Simulated vs real TTFT ({json.dumps(head)})", sim_vs_real_table(sim, reals, engines)]
        if any(v.get("requests") for v in reals.values()) and "workload" in meta:
            by_rid = sim_requests(meta["workload"], meta["rate"], meta["duration_s"], meta["seed"])
            parts.append(pairs_table(reals, by_rid))
    rmeta = _load(out / "routers-meta.json")
    if rmeta:
        rr = {t: _load(out / f"routers-{t}.json") for t in rmeta.get("runs") or rmeta["policies"]}
        rs = {p: _load(out / f"routers-sim-{p}.json") for p in rmeta["policies"]}
        head = {k: rmeta[k] for k in ("workload", "rate", "duration_s", "seed") if k in rmeta}
        rr = {k: v for k, v in rr.items() if v}
        parts += [f"### Routers on the cluster ({json.dumps(head)})",
                  routers_table(rr, {k: v for k, v in rs.items() if v})]
        if len(rmeta.get("runs") or []) > len(rmeta["policies"]):  # repeated runs: their medians
            parts.append(routers_median_table(rr, rmeta["policies"]))
        if "workload" in rmeta:
            specs = rmeta.get("specs") or {}
            for p in rmeta["policies"]:
                mine = {k: v for k, v in rr.items() if (k == p or k.rsplit("-r", 1)[0] == p) and v.get("requests")}
                name, opts = _sim_router(specs.get(p, p))
                if name in SIM_ROUTERS and mine:
                    by_rid = sim_requests(rmeta["workload"], rmeta["rate"], rmeta["duration_s"], rmeta["seed"],
                                          router=name, router_options=opts)
                    parts.append(pairs_table(mine, by_rid))
    parts.append(code_versions(out))
    text = "\n\n".join(parts) + "\n"
    (out / "tables.md").write_text(text)
    return text
