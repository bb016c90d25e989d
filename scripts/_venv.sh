# Sourced by the scripts: create or reuse .venv in the repo and install what pyproject.toml declares.
# Reinstalls only when pyproject.toml changed (a stamp file holds its hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.fairway-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # uv installs the same packages faster than pip (about 40 s against 50 s here on a fresh venv,
  # most of it compiling the bytecode, which pip does too: with PYTHONDONTWRITEBYTECODE set, as on
  # these machines, every Ray process would otherwise compile its imports anew and each cluster
  # start takes twice as long); where uv cannot be had or cannot reach an index, pip does it.
  if ! { .venv/bin/python -m pip install -q uv >/dev/null 2>&1 &&
         .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[test]"; }; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -e ".[test]"
  fi
  echo "$want" > "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
