#!/usr/bin/env bash
# Run the test suite (lint first). Creates/reuses .venv and installs the project.
# Extra arguments go to pytest, e.g. scripts/test.sh -k fairway
source "$(dirname "$0")/_venv.sh"
ruff check .
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
