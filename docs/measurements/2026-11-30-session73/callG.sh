#!/usr/bin/env bash
# Session 73, call G (one H200): the weight gradients' TMA-store epilogue with the empty-tile choice made once per tile
# instead of a select per value (epilogue_wgrad_no_select.diff: 128 FSEL a thread and tile fewer on the cooperative
# tile), against 7c40b7f's: two machmoe-bench binaries, ncu (unlocked clock) of one backward's dW2 and dW1, the two
# alternating, on three main rows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
cp build/bin/machmoe-bench /tmp/bench_main
# (As run, this copied the patched whole file, epilogue_wgrad_no_select.cuh, over the header; the diff is the same.)
git apply docs/measurements/2026-11-30-session73/epilogue_wgrad_no_select.diff
touch src/gpu/hopper/epilogue_wgrad.cuh
cmake --build build --target machmoe-bench --parallel "$(nproc)" > "$OUT/build_nosel.log" 2>&1
echo "variant build exit $? ($(( $(date +%s) - t0 )) s)"
cp build/bin/machmoe-bench /tmp/bench_nosel
git apply -R docs/measurements/2026-11-30-session73/epilogue_wgrad_no_select.diff
for cfg in 120B-2048 30B-1024 7B-256; do for side in main nosel nosel main; do
  left 230 || { echo "== skipped $cfg $side: time"; continue; }
  echo "== ncu $cfg $side" >> "$OUT/ncu.csv"
  timeout 60 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:MainloopVarlenK" --launch-count 2 --csv --page raw \
    --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,smsp__inst_executed.sum \
    /tmp/bench_$side --config $cfg --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    2>/dev/null | grep -E '^"(ID|[0-9])' >> "$OUT/ncu.csv"
done; done
xz -f "$OUT/ncu.csv"
echo "total: $(( $(date +%s) - t0 )) s"
