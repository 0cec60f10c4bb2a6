#!/usr/bin/env bash
# Session 73, call H (one H200): the dH kernel's shared-memory bank conflicts (session 72's ncu: 7.8-way loads and
# 5.3-way stores on average on 7B (256,128,8)), instruction by instruction: ncu --set full of one dH launch on 7B
# (256,128,8) at the unlocked clock, its details page and its SASS page as CSV (per instruction: executions, stall
# samples, shared-memory wavefronts and their ideal count).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
timeout 100 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
  -k "regex:EpilogueActivationGrad" --launch-count 1 -o "$OUT/dh" ./build/bin/machmoe-bench \
  --config 7B-256 --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > "$OUT/ncu_dh.log" 2>&1
echo "ncu exit $? ($(( $(date +%s) - t0 )) s)"
ncu --import "$OUT/dh.ncu-rep" --page source --csv --print-source sass > "$OUT/dh_sass.csv" 2>&1
ncu --import "$OUT/dh.ncu-rep" --page details > "$OUT/dh_details.txt" 2>&1
rm -f "$OUT/dh.ncu-rep"
xz -f "$OUT/dh_sass.csv" "$OUT/dh_details.txt" "$OUT/ncu_dh.log"
echo "total: $(( $(date +%s) - t0 )) s"
