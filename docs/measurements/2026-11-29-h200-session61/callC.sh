#!/usr/bin/env bash
# Session 61 call C: the benchmark's stage runs now last at least --time-ms (like the timed passes); every main row,
# top-K, with the default cache (pre-activation H kept) and the recompute mode (input_only, T7), 300 ms windows; the
# board's clocks and power logged every 100 ms.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
for cache in preact input_only; do
  st "all configs, cache $cache"
  timeout 280 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$cache.json" > "$OUT/all_$cache.txt" 2>&1
  echo "rc $?"; grep -E "^config |^  (forward|backward) |^  stages" "$OUT/all_$cache.txt" | cut -c1-150
done
kill $SMI
st done
