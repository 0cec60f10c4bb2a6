#!/bin/bash
# Call 3: the up-projection's wide tile with k-blocks of 32 in 8 stages (Tile128x256CooperativeCluster2K32,
# MACHMOE_HOPPER_TILE_K=32) against main's k-blocks of 64 in 4: build, the up-projection tests with it forced
# (against float64 and the reference GEMM) and memcheck on one of them, then A/B of machmoe-bench in the order
# A B B A (A: main's tile, B: k-blocks of 32), the forward and its up_projection stage.
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( time MACHMOE_JOBS=16 bash scripts/build.sh ) > $OUT/build.log 2>&1; echo "build rc $?"; tail -3 $OUT/build.log
t=./build/tests/machmoe_gpu_tests
f='HopperUpProjection*:HopperEdgeTiles.UpProjection*:HopperSchedulerProperties*'
MACHMOE_HOPPER_TILE_K=32 timeout 150 $t --gtest_filter="$f" --gtest_brief=1 > $OUT/k32_tests.log 2>&1
echo "k32 tests rc $?"; tail -4 $OUT/k32_tests.log
MACHMOE_HOPPER_TILE_K=32 timeout 120 compute-sanitizer --tool memcheck $t \
  --gtest_filter='HopperEdgeTiles.UpProjectionManyTilesPerCta' --gtest_brief=1 > $OUT/k32_memcheck.log 2>&1
echo "memcheck rc $?"; tail -3 $OUT/k32_memcheck.log
for cfg in 7B-256 7B-512 1.4B-256 30B-256 120B-2048; do
  for k in 0 32 32 0; do
    echo "== $cfg MACHMOE_HOPPER_TILE_K=$k" >> $OUT/ab.txt
    MACHMOE_HOPPER_TILE_K=$k timeout 60 ./build/bin/machmoe-bench --config $cfg --warmup-ms 200 --time-ms 200 \
      >> $OUT/ab.txt 2>&1
  done
done
grep -E "^==|^  (forward|backward) |up_projection" $OUT/ab.txt
