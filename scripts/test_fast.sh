#!/usr/bin/env bash
# The inner loop: lint, the import contracts, and every test that starts no cluster, Ray or
# Prometheus and runs no long simulation (pytest -m "not e2e and not slow"). The full suite is
# scripts/test.sh. Extra arguments go to pytest, e.g. scripts/test_fast.sh tests/fairway -x
source "$(dirname "$0")/_venv.sh"
ruff check .
lint-imports
set +e
python -m pytest -m "not e2e and not slow" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
