#!/usr/bin/env bash
# Session 77, call B (one H200): build the final GPU code (the router backward in two passes, c2c70e9; token
# rounding's tie search through one helper, the commit after it), the whole gtest GPU suite in two shards side by
# side, then every main row with top-K in the default cache mode and in the recompute mode (300 ms windows).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st gtest; bash scripts/ab.sh gboth 2>&1 | grep -v "^\[" ; grep -h "FAILED\|Failure" "$OUT"/gtest_g*.log | head -n 20
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 3 > "$OUT/callB_gtest_g${i}_tail.txt"; done
xz -f "$OUT"/gtest_g*.log
for cache in preact input_only; do
  st "all rows $cache"
  left=$(( 585 - ($(date +%s) - S) )); [ "$left" -gt 60 ] || break
  timeout "$left" ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/callB_all_$cache.json" > "$OUT/callB_all_$cache.txt" 2>&1
  echo "all rows $cache exit $?"; grep -E "^  (forward|backward) " "$OUT/callB_all_$cache.txt" | head -n 30
  xz -f "$OUT/callB_all_$cache.txt"
done
st done
