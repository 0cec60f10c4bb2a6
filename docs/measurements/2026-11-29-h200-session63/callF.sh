#!/usr/bin/env bash
# Session 63 call F: every main row on the landed code (9bdf37a: the dH kernel's wide tile also at n = 256 and 512
# where d >= 4096), top-K, 300 ms windows: the default cache twice, the recompute mode (input_only) once; clocks
# logged every 100 ms.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
for run in preact_1 input_only_1 preact_2; do
  cache=${run%_*}
  st "all configs, $run"
  timeout 100 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$run.json" > "$OUT/all_$run.txt" 2>&1
  echo "rc $?"; grep -E "^config |^  (forward|backward) " "$OUT/all_$run.txt" | cut -c1-110
done
kill $SMI
st done
