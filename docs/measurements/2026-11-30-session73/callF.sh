#!/usr/bin/env bash
# Session 73, call F (one H200): with the new producer (7c40b7f), do the weight gradients still want the wide
# cooperative tile where the heuristic takes it? ncu (unlocked clock) of dW2 and dW1, one backward's launches, with
# the heuristic's tile and with MACHMOE_HOPPER_TILE_N=128 (the 128 x 128 ping-pong tile, whose epilogue runs behind
# the other warpgroup's mainloop), alternating, on three main rows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
for cfg in 120B-2048 30B-1024 7B-256 30B-256; do for tile in 0 128 128 0; do
  left 300 || { echo "== skipped $cfg $tile: time"; continue; }
  echo "== ncu $cfg tile $tile" >> "$OUT/ncu.csv"
  MACHMOE_HOPPER_TILE_N=$tile timeout 60 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:MainloopVarlenK" --launch-count 2 --csv --page raw \
    --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,smsp__inst_executed.sum \
    ./build/bin/machmoe-bench --config $cfg --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    2>/dev/null | grep -E '^"(ID|[0-9])' >> "$OUT/ncu.csv"
done; done
xz -f "$OUT/ncu.csv"
echo "total: $(( $(date +%s) - t0 )) s"
