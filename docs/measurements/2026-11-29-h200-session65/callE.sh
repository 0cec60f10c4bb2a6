#!/usr/bin/env bash
# Session 65, call E: every main row on the landed GPU code (the GLU dH epilogue's 8-byte accesses), top-K, both
# cache modes, 300 ms windows, then --profile's back-to-back figures (final form: host enqueue time) on 1.4B (256,128,8).
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_E.csv" 2>&1 &
SMI=$!
st build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" --target machmoe-bench >> "$OUT/build.log" 2>&1
echo "build exit $?"
for cache in preact input_only; do
  st "all configs, $cache"
  timeout 240 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$cache.json" > "$OUT/all_$cache.txt" 2>&1
  echo "exit $?"
done
st profile
timeout 60 ./build/bin/machmoe-bench --config 1.4B-256 --routing topk --iters 5 --warmup 2 --stage-runs 5 \
  --warmup-ms 300 --time-ms 300 --profile 2>&1 | grep -E "back-to-back|^  (forward|backward) " | tee "$OUT/profile.txt"
kill $SMI; xz -9 "$OUT/clocks_E.csv"
st done
