#!/usr/bin/env bash
# Session 77, call D (one H200, fresh): T7 on the rows where session 75 found it over 1.20, the two cache modes of one
# binary in turn (A B B A), two rounds: forward + backward with the recompute mode (input_only) over the default.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st t7
for round in 1 2; do
  for cfg in 120B-2048 120B-1024 120B-512 30B-1024; do
    for cache in preact input_only input_only preact; do
      [ $(( $(date +%s) - S )) -lt 540 ] || break 3
      echo "== $cfg $cache round $round"
      timeout 40 ./build/bin/machmoe-bench --config $cfg --cache $cache --warmup-ms 300 --time-ms 300 2>/dev/null |
        grep -E "^  (forward|backward) "
    done
  done
done > "$OUT/callD_t7.txt"
cat "$OUT/callD_t7.txt"
st done
