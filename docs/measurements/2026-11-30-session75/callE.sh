#!/usr/bin/env bash
# Session 75, call E (the 2-GPU H200): two new GPU tests of the layer's public API (every raw buffer at a 16-byte
# boundary past 256-byte alignment; one expert with any expert stride of the weights, biases and weight gradients),
# then the whole gtest GPU suite, whose harness (tests/gpu/gpu_support.hpp: GpuRunOptions, DeviceBuffer's leading
# canary) changed with them: shard 0 on GPU 0, shard 1 on GPU 1. No library source changed since call B.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
CUDA_VISIBLE_DEVICES=0 timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuLayerProperties.BuffersAtAnySixteenByteBoundaryGiveTheSameResults:GpuLayerProperties.OneExpertWithAnyExpertStrideGivesTheSameResults' \
  > "$OUT/callE_new_tests.log" 2>&1
echo "new tests exit $?: $(grep -v "reference GEMM" "$OUT/callE_new_tests.log" | tail -n 2 | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
grep -B2 -A12 "Failure" "$OUT/callE_new_tests.log" | head -n 60
left=$(( 390 - ($(date +%s) - t0) ))
for i in 0 1; do
  ( CUDA_VISIBLE_DEVICES=$i GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout "$left" ./build/tests/machmoe_gpu_tests \
      --gtest_brief=1 > "$OUT/callE_gtest_g$i.log" 2>&1
    echo "g$i exit $?: $(grep -v "reference GEMM" "$OUT/callE_gtest_g$i.log" | tail -n 2 | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]" ) &
done
wait
grep -h "FAILED\|Failure" "$OUT"/callE_gtest_g*.log | head -n 20
xz -f "$OUT"/callE_*.log
echo "total [$(( $(date +%s) - t0 )) s]"
