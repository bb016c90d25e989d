#!/usr/bin/env bash
# The full policy comparison behind docs/benchmarks.md: every workload x 4 loads x the baselines.
# Takes ~30-40 min on 2 cores. Results: out/matrix/<workload>/{sweep.json,*.png}, log on stdout.
source "$(dirname "$0")/_venv.sh"
P="fcfs,lpm,hrrn,k-lpm,fairway,fairway[fair_order=ratio],srpt-oracle"
D=${DURATION:-300}
run() { python -m sim sweep --policies "$P" --duration "$D" --jobs 2 "$@"; }
run --workload rag --rates 6,12,18,24 --out out/matrix/rag
run --workload rag-spike --rates 4,8,12,16 --out out/matrix/rag-spike
run --workload mixed --rates 4,8,12,16 --out out/matrix/mixed
run --workload mixed-spike --rates 3,6,9,12 --out out/matrix/mixed-spike
run --workload agentic --rates 0.1,0.2,0.3,0.4 --out out/matrix/agentic
run --workload agentic-spike --rates 0.05,0.1,0.2,0.3 --out out/matrix/agentic-spike
TRACE=../shared/traces/mooncake_synthetic_trace.jsonl
if [ -f "$TRACE" ]; then
  python -m sim sweep --policies "$P" --workload "trace:$TRACE" --duration 1e9 --jobs 2 \
    --time-scales 0.6,0.8,1.0,1.2 --out out/matrix/mooncake
fi
