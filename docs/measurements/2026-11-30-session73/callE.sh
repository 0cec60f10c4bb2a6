#!/usr/bin/env bash
# Session 73, call E (one H200): where the weight-gradient kernels' warps wait with the new producer (7c40b7f), as
# session 72's callE.sh measured them before it: ncu --set full of dW2 and of dW1 on 120B (2048,64,4) (one launch
# each, unlocked clock), each report's details page and its SASS page as CSV (warp-stall samples per instruction).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
for which in dw2 dw1; do
  skip=0; [ $which = dw1 ] && skip=1
  timeout 100 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
    -k "regex:MainloopVarlenK" --launch-skip $skip --launch-count 1 -o "$OUT/$which" ./build/bin/machmoe-bench \
    --config 120B-2048 --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > "$OUT/ncu_$which.log" 2>&1
  echo "ncu $which exit $? ($(( $(date +%s) - t0 )) s)"
  ncu --import "$OUT/$which.ncu-rep" --page source --csv --print-source sass > "$OUT/${which}_sass.csv" 2>&1
  ncu --import "$OUT/$which.ncu-rep" --page details > "$OUT/${which}_details.txt" 2>&1
  echo "sass $which exit $? lines $(wc -l < "$OUT/${which}_sass.csv")"
  rm -f "$OUT/$which.ncu-rep"
  xz -f "$OUT/${which}_sass.csv" "$OUT/ncu_$which.log" "$OUT/${which}_details.txt"
done
echo "total: $(( $(date +%s) - t0 )) s"
