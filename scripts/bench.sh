#!/usr/bin/env bash
# Main job: the simulator benchmark. Prints the policy comparison tables and writes JSON + plots
# to out/bench/<scenario>/. Creates/reuses .venv and installs the project.
source "$(dirname "$0")/_venv.sh"
P="fcfs,lpm,hrrn,k-lpm,fairway"
python -m sim sweep --workload agentic --concurrency 100 --rates 0.5 --seeds 0,1,2 \
  --policies "$P" --out out/bench/agentic-c100
python -m sim sweep --workload mixed-spike --rates 3,6,9 --policies "$P" --out out/bench/mixed-spike
python -m sim sweep --workload rag-spike --rates 4,8,12 --policies "$P" --out out/bench/rag-spike
echo "plots: out/bench/*/ttft_vs_rate.png, out/bench/*/ttft_cdf.png"
