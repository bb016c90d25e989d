#!/usr/bin/env bash
# The real-vLLM (CPU) tests in one command: set up .venv-vllm and the tiny Llama
# (scripts/vllm_cpu_setup.sh, idempotent), then run the engine adapter tests and the end-to-end
# cluster test (serve run deploy/cluster-vllm-cpu.yaml) with .venv-vllm's python, and the GPU-step
# decoder's tests (bench/gpu_steps.py on the CPU; they need the torch that .venv-vllm has).
#
#   scripts/test_vllm.sh                 # ~8 min from nothing (3 min install), ~5 min warm (2 cores)
#   scripts/test_vllm.sh -k prefix       # extra arguments go to pytest
#   scripts/test_vllm.sh --part engine   # only the tests that start no Ray cluster (the engine
#                                        # adapter, the GPU-step decoder); --part cluster: only the
#                                        # cluster test (scripts/test.sh runs the two parts apart)
#
# Fails when any test fails, and also when none ran or any was skipped: after the setup, a skip
# means the vLLM environment is broken, not absent.
set -euo pipefail
ENGINE_TESTS=(tests/replicas/engines/test_vllm_engine.py tests/bench/test_gpu_steps_torch.py)
CLUSTER_TESTS=(tests/e2e/test_vllm_cluster.py)
tests=("${ENGINE_TESTS[@]}" "${CLUSTER_TESTS[@]}")
if [ "${1:-}" = "--part" ]; then
  case "${2:-}" in
    engine) tests=("${ENGINE_TESTS[@]}") ;;
    cluster) tests=("${CLUSTER_TESTS[@]}") ;;
    *) echo "--part takes engine or cluster, not '${2:-}'" >&2; exit 2 ;;
  esac
  shift 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
t0=$(date +%s)
scripts/vllm_cpu_setup.sh
t1=$(date +%s)

report=$(mktemp)
trap 'rm -f "$report"' EXIT
set +e
HF_HUB_OFFLINE=1 nice -n 10 .venv-vllm/bin/python -m pytest "${tests[@]}" -q -p no:cacheprovider "$@" | tee "$report"
rc=${PIPESTATUS[0]}
set -e
t2=$(date +%s)
echo "[test_vllm] setup $((t1 - t0)) s, tests $((t2 - t1)) s"
if [ "$rc" -eq 5 ]; then
  echo "[test_vllm] no tests ran: treating as failure" >&2
  exit 1
fi
if [ "$rc" -eq 0 ] && grep -qE "[0-9]+ skipped" "$report"; then
  echo "[test_vllm] tests were skipped after the setup (see the SKIPPED lines above): treating as failure" >&2
  exit 1
fi
exit "$rc"
