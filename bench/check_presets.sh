#!/usr/bin/env bash
# `vlpack check` on every tiny preset in float32 and bfloat16, one JSON report a line.
#   bash bench/check_presets.sh OUT.jsonl [EXTRA vlpack check ARGS...]
# Prints one line per run: preset, dtype, exit status (0 passed, 1 failed, 2 could not run).
set -u
out=${1:?usage: check_presets.sh OUT.jsonl [ARGS...]}; shift
: > "$out"
for m in tiny-qwen2_vl tiny-qwen2_5_vl tiny-qwen3_vl tiny-qwen3_vl_moe tiny-qwen3_5 tiny-qwen3_5_moe; do
  for d in float32 bfloat16; do
    timeout "${CHECK_S:-120}" python3 -m vlpack check --model "$m" --dtype "$d" --json "$@" \
      >> "$out" 2> >(grep -v Warning >&2)
    echo "$m $d rc=$?"
  done
done
