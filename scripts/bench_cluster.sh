#!/usr/bin/env bash
# Cluster benchmarks (issue 4): router overhead, simulated vs real TTFT, router policies through the
# real cluster. Starts its own `serve run` clusters one at a time (sim engine, deploy/cluster.yaml,
# HTTP port $FAIRWAY_BENCH_PORT, default 8471, so it never shares a port with the e2e tests), and
# writes JSON, commands.txt and tables.md to out/bench-cluster/. About 35 min on 2 cores with the
# defaults; extra arguments go to `python -m bench.cluster all` (e.g. --repeats 1).
# Creates/reuses .venv and installs the project.
source "$(dirname "$0")/_venv.sh"
OUT="${BENCH_CLUSTER_OUT:-out/bench-cluster}"
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/commands.txt "$OUT"/tables.md
python -m bench.cluster all --out "$OUT" "$@"
echo "tables: $OUT/tables.md"
