#!/usr/bin/env bash
# Session 64, call 2: every main row with the dH epilogue's batched H loads (top-K, 300 ms windows, default cache;
# clocks every 200 ms), then the whole gtest GPU binary in two shards.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_2.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 1
for run in preact_1; do
  cache=${run%_*}
  st "all configs, $run"
  timeout 100 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$run.json" > "$OUT/all_$run.txt" 2>&1
  echo "rc $?"; grep -E "^config |^  (forward|backward) " "$OUT/all_$run.txt" | cut -c1-110
done
kill $SMI
st gtest
bash scripts/ab.sh gboth
st done
