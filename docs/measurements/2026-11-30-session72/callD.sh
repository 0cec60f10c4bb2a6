#!/usr/bin/env bash
# Session 72, call D (one H200): dW1 on a 256 x 128 cooperative tile (Tile256x128Cooperative: the gathered X on the
# tile's 128-wide side, dH by TMA on its 256-wide side; dw1_tall_tile.diff) against the 128 x 256 tile, in one binary
# switched by MACHMOE_HOPPER_WGRAD_TILE_M=128|256: the weight-gradient GPU tests (every tile), the layer on six main
# rows in two rounds, the two sides alternating, ncu of the new kernel on 120B (2048,64,4), memcheck of its bitwise test.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
run() {  # run <round> <config> <tile_m>
  left 470 || { echo "== skipped $*: time"; return; }
  echo "== round $1 $2 tile_m $3"
  MACHMOE_HOPPER_WGRAD_TILE_M=$3 timeout 60 ./build/bin/machmoe-bench --config "$2" --warmup-ms 200 --time-ms 200 \
    --stage-runs 1 --json "$OUT/r$1_$2_$3.json" 2>/dev/null | tee -a "$OUT/bench_full.txt" |
    grep -E "^  (forward|backward) |backward/dw[12]"
}
{
  for cfg in 120B-2048 120B-512 30B-1024 30B-256 7B-256 1.4B-256; do run 1 $cfg 128; run 1 $cfg 256; done
  for cfg in 120B-2048 120B-512 30B-1024 30B-256 7B-256 1.4B-256; do run 2 $cfg 256; run 2 $cfg 128; done
} 2>&1 | tee "$OUT/bench.txt"
if left 500; then
  MACHMOE_HOPPER_WGRAD_TILE_M=256 timeout 60 ncu --clock-control none --set full --import-source no \
    --kernel-name-base demangled -k "regex:MainloopVarlenK<Tile256x128" --launch-count 1 ./build/bin/machmoe-bench \
    --config 120B-2048 --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > "$OUT/ncu_dw1_tall_120b.txt" 2>&1
  echo "ncu exit $?"
fi
if left 530; then
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter='HopperWeightGrad.Dw1TallTileIsBitwiseTheWideOne' > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ')"
fi
xz -f "$OUT/bench_full.txt" "$OUT/memcheck.log" "$OUT/ncu_dw1_tall_120b.txt" 2>/dev/null
cd "$OUT" && tar -cJf jsons.tar.xz r*.json 2>/dev/null && rm -f r*.json
echo "total: $(( $(date +%s) - t0 )) s"
