#!/usr/bin/env bash
# Every step grid of bench/gpu_steps.py in one call on a lent GPU machine (the device tool's `run`),
# torch only: 8B and 14B, fused and unfused, about 6.5 minutes on an H200 (at most 9.2 by the
# limits below, so a slow grid cannot take the others' time). Six files land in $OUT (or
# ./out/steps; the device tool brings back at most 8):
#
#   run(command="bash scripts/gpu_steps.sh", timeout_s=600)
#
# Then, here: copy the .jsonl files into bench/data/, `python -m bench.gpu_steps fit` and
# `python -m bench.gpu_steps compare` (docs/cost-model.md, "Whole steps on an H200").
set -u
out="${OUT:-out/steps}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
step() {  # limit_s file args...
  local limit=$1 file=$2
  shift 2
  echo "== $file" >> "$out/log.txt"
  timeout "$limit" python3 bench/gpu_steps.py measure --out "$out/$file" "$@" >> "$out/log.txt" 2>&1
  echo "$file: rc=$? $(tail -1 "$out/log.txt")"
}
step 120 h200_steps_fused.jsonl --fuse --no-eager --kinds decode,prefill,mixed,multi
step 180 h200_14b_steps_fused.jsonl --fuse --no-eager --shape qwen2.5-14b-like --kinds decode,prefill,mixed,multi
step 100 h200_steps.jsonl
step 150 h200_14b_steps.jsonl --shape qwen2.5-14b-like
