#!/usr/bin/env bash
# The full policy comparison behind docs/benchmarks.md (section 2.2; per-policy tables in
# docs/history/2026-11-30-queue-policy-matrix.md): every workload x 4 loads x the baselines.
# Takes about an hour on 2 cores. Results: out/matrix/<workload>/{sweep.json,*.png}, log on stdout.
source "$(dirname "$0")/_venv.sh"
P="fcfs,lpm,hrrn,k-lpm,fairway,srpt-oracle"
D=${DURATION:-600}  # open loop: >= 2,000 requests at the lowest rate
run() { python -m sim sweep --policies "$P" --duration "$D" --jobs 2 "$@"; }
run --workload rag --rates 6,12,18,24 --out out/matrix/rag
run --workload rag-spike --rates 4,8,12,16 --out out/matrix/rag-spike
run --workload mixed --rates 4,8,12,16 --out out/matrix/mixed
run --workload mixed-spike --rates 3,6,9,12 --out out/matrix/mixed-spike
run --workload agentic --rates 0.1,0.2,0.3,0.4 --seeds 0,1,2 --out out/matrix/agentic
run --workload agentic-spike --rates 0.05,0.1,0.2,0.3 --seeds 0,1,2 --out out/matrix/agentic-spike
run --workload agentic --concurrency 100 --rates 0.5 --seeds 0,1,2 --out out/matrix/agentic-c100
run --workload agentic-spike --concurrency 100 --rates 0.5 --seeds 0,1,2 --out out/matrix/agentic-spike-c100
TRACE=../shared/traces/mooncake_synthetic_trace.jsonl
if [ -f "$TRACE" ]; then
  python -m sim sweep --policies "$P" --workload "trace:$TRACE" --duration 1e9 --jobs 2 \
    --time-scales 0.4,0.6,0.8,1.0 --out out/matrix/mooncake
fi
