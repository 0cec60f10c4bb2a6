#!/usr/bin/env bash
# Session 73, call D (one H200): every main row on the landed code (7c40b7f, the weight gradients' new producer), top-K,
# 300 ms windows: the default cache mode, the recompute mode, and the default again if time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
for run in preact input_only preact2; do
  cache=${run%2}
  left 380 || { echo "== $run skipped: time"; continue; }
  timeout 200 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$run.json" > "$OUT/all_$run.txt" 2>&1
  echo "$run exit $? ($(( $(date +%s) - t0 )) s)"
done
xz -f "$OUT"/all_*.txt
echo "total: $(( $(date +%s) - t0 )) s"
