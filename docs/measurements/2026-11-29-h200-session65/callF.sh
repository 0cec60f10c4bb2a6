#!/usr/bin/env bash
# Session 65, call F: compute-sanitizer racecheck and memcheck of the dH kernel's edge-tile and wide-tile layer tests on
# the landed code (session 64's racecheck of them ran past its 100 s limit), with a longer limit.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" --target machmoe_gpu_tests >> "$OUT/build.log" 2>&1
echo "build exit $?"
st racecheck
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout ${RC_LIMIT:-200} compute-sanitizer --tool racecheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperEdgeTiles.DhKernelEveryActivation:GpuLayerProperties.WideDhTileInTheLayerMatchesFloat64' \
  > "$OUT/racecheck_edge.log" 2>&1
echo "racecheck exit $? $(grep -E 'RACECHECK SUMMARY|PASSED|FAILED' "$OUT/racecheck_edge.log" | sort -u | tr '\n' ' ')"
st done
