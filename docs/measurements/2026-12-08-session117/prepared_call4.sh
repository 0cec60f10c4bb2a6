#!/usr/bin/env bash
# Prepared in session 116, rebased in session 117 on the one environment reader (src/core/env.hpp), run in neither for
# want of a device: the first run of place_sorted_four_tiles.diff (the sorted place kernel also at four tiles a block,
# 128 threads, for up to 128 experts: twice the blocks of the eight-tile kernel, for the E <= 64 rows where eight tiles
# leave most SMs idle, e.g. 48 blocks on 7B (512,64,4)).
# kAuto is unchanged by the diff; MACHMOE_PLACE_FOUR_TILES=1 makes it take four tiles wherever E <= 128.
# Before the call, on the development machine: `git apply
# docs/measurements/2026-12-08-session117/place_sorted_four_tiles.diff`, `bash scripts/build.sh`, and carry build/bin,
# build/lib and build/tests/machmoe_gpu_tests.
#   1. the routing gtests as a gate (each test forces all three place kernels);
#   2. machmoe-bench, top-K, 300 ms windows, D F F D (D = the layer's choice: per-tile on the E <= 64 rows, eight
#      tiles on 7B (256,128,8); F = MACHMOE_PLACE_FOUR_TILES=1) on the rows four tiles could take;
#   3. compute-sanitizer memcheck and racecheck on the routing-metadata tests, then the whole GPU suite.
# If F's routing_metadata is below D's on a row with its forward not slower, set kAuto's rule for four tiles to the
# rows it won (place_kernel_for and GpuRoutingMetadata.PlaceKernelChoice) and land it after the suite passed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
gtest_gate '*GpuRoutingMetadata*'
st "routing gtests"
# Four-tile blocks: 7B (512,64,4) 96, 1.4B (512,64,4) 160, 30B (1024,64,4) and 120B (2048,64,4) 128,
# 1.4B (1024,32,2) 80, 7B (256,128,8) 192 (against eight tiles' 96).
for cfg in 7B-512 1.4B-512 30B-1024 120B-2048 1.4B-1024 7B-256; do
  for side in D F F D; do
    echo "== $cfg topk $side"; bench_routing "$([ $side = F ] && echo MACHMOE_PLACE_FOUR_TILES=1)" $cfg
  done
done 2>&1 | tee "$OUT/ab.txt"
st "A/B rows"
SF='*/GpuRoutingMetadata.*:GpuRoutingMetadata.PlaceKernelChoice:*GpuRoutingMetadataLayout.*one_tile*:*GpuRoutingMetadataLayout.*caller_256*:*GpuRoutingMetadataLayout.*topk_257*:*GpuRoutingMetadataLayout.*caller_100_experts*' \
  OUT=$OUT bash scripts/ab.sh san 2>&1 | grep -E "exit|SUMMARY|PASSED|FAILED"
st "san"
OUT=$OUT timeout $(( $(left) - 15 )) bash scripts/ab.sh suites; st "suites exit $?"
(cd "$OUT" && rm -f gtest_g*.rc && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
