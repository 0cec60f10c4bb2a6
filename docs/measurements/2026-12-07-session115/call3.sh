#!/usr/bin/env bash
# Prepared in session 115, not run (the session's device time ran out): the landing call of place_sorted_choice.diff
# (the place kernel sorting blocks of 2048 pairs, taken by PlaceKernel::kAuto only for E = 128 to 256 with at least
# 96 blocks, after call 2 measured it slower on 7B (512,64,4), E = 64 at 48 blocks; the tests force each kernel).
# Before the call, on the development machine: `git apply docs/measurements/2026-12-07-session115/place_sorted_choice.diff`,
# `bash scripts/build.sh`, and carry build/bin, build/lib and build/tests/machmoe_gpu_tests.
#   1. the routing gtests as a gate (GpuRoutingMetadata.PlaceKernelChoice among them);
#   2. machmoe-bench, top-K, 300 ms windows, T N N T (T = MACHMOE_PLACE_BY_TILE=1, N = the layer's choice) on the
#      E = 128 rows with 128 blocks that kAuto sorts unmeasured (30B (512,128,8), 120B (1024,128,8)); 7B (512,64,4)
#      once (N must now equal T: both the per-tile kernel);
#   3. compute-sanitizer memcheck and racecheck on the routing-metadata tests, then the whole GPU suite
#      (scripts/ab.sh suites, about 270 s on an H100).
# Land only if the suite and both sanitizers pass; if N's routing_metadata is not below T's on a row of step 2,
# raise kPlaceSortedMinPairs above that row's pairs (and its test) before landing.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
gtest_gate '*GpuRoutingMetadata*'
st "routing gtests"
bench() {  # side, config
  local vars=""
  [ "$1" = T ] && vars=MACHMOE_PLACE_BY_TILE=1
  with_env "$vars" timeout 40 ./build/bin/machmoe-bench --config "$2" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
    grep -E "^  (forward|backward) |topk_scores|routing_metadata"
}
for cfg in "30B-512:T N N T" "120B-1024:T N N T" "7B-512:T N"; do
  for side in ${cfg#*:}; do echo "== ${cfg%%:*} topk $side"; bench $side ${cfg%%:*}; done
done 2>&1 | tee "$OUT/ab.txt"
st "A/B rows"
SF='*/GpuRoutingMetadata.*:GpuRoutingMetadata.PlaceKernelChoice:*GpuRoutingMetadataLayout.*one_tile*:*GpuRoutingMetadataLayout.*caller_256*:*GpuRoutingMetadataLayout.*topk_257*' \
  OUT=$OUT bash scripts/ab.sh san 2>&1 | grep -E "exit|SUMMARY|PASSED|FAILED"
st "san"
OUT=$OUT timeout $(( $(left) - 15 )) bash scripts/ab.sh suites; st "suites exit $?"
(cd "$OUT" && rm -f gtest_g*.rc && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
