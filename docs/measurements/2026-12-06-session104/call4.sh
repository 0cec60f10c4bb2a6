#!/usr/bin/env bash
# Session 104, call 4: compute-sanitizer on the tests that run the refactored argument builders' paths: memcheck on
# the new fallback-policy gtest and the chunked GEMM + gather-sum tests (forward Y and backward dX~ in chunks of
# tokens), racecheck on the new gtest. Build first (a fresh machine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call4.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call4.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
san() {  # tool, filter, seconds
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout "$3" compute-sanitizer --tool "$1" --error-exitcode 9 \
    ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$2" > "$OUT/sanitize_$1_call4.log" 2>&1
  echo "$1 exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/sanitize_$1_call4.log" | sort -u | tr '\n' ' ')"
}
san memcheck 'GpuFallbackPolicy.*:GpuLayerProperties.DxInChunksOfTokensIsBitwiseOnePass:GpuLayerProperties.HeuristicTokenChunksMatchFloat64' 300
san racecheck 'GpuFallbackPolicy.*' 150
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
