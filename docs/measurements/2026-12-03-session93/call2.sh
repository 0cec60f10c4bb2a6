#!/usr/bin/env bash
# Session 93, call 2 (one H200): main's code (session 92's GPU code) plus the dH test of every count of a warp's valid
# rows (HopperDhKernelProperties.EveryCountOfAWarpsRows, taken from session 92's prepared diff without the diff's
# kernel changes, which call 1 measured and did not land). Build, the new test with the dH tests, memcheck on the new
# test, then pytest's one-GPU tests in full (session 92 ran 173 of them before its budget ended).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
# A warm machine from call 1 may hold objects built from the diff; the checkout's files are older, so touch them.
touch src/gpu/hopper/* tests/gpu/test_hopper_gemm.cpp
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st dh tests
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*HopperDh*:HopperEdgeTiles.Dh*' \
  > "$OUT/dh_tests.log" 2>&1
echo "dh tests exit $?"; grep -v "reference GEMM" "$OUT/dh_tests.log" | grep -E "FAILED|PASSED|tests ran" | head -20
st memcheck
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperDhKernelProperties.EveryCountOfAWarpsRows' \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ')"
st pytest; bash scripts/ab.sh pyg 2>&1 | grep -vE "^\[|== "
grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -n 3
rm -f "$OUT"/build*.log
st done
