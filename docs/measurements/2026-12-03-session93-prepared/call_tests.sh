#!/usr/bin/env bash
# Prepared in session 93, not run: the dH test of a warp's valid rows with every count, 1 to 15
# (every_count_of_a_warps_rows.diff: segments of 4, 6, 8, 10, 12, 20, 38, 56, 72, 90 and 140 rows added, the test named
# EveryCountOfAWarpsRows again). One call (a fresh H200, ~150 s): apply, build, the dH tests, memcheck on the new test.
# If they pass: git apply the diff and commit it, quoting the summaries.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=docs/measurements/2026-12-03-session93-prepared
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git apply $P/every_count_of_a_warps_rows.diff && touch tests/gpu/test_hopper_gemm.cpp && git diff --stat
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st dh tests
timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*HopperDh*:HopperEdgeTiles.Dh*' \
  > "$OUT/dh_tests.log" 2>&1
echo "dh tests exit $?"; grep -v "reference GEMM" "$OUT/dh_tests.log" | grep -E "FAILED|PASSED|tests ran" | head -20
st memcheck
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperDhKernelProperties.EveryCountOfAWarpsRows' \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ')"
rm -f "$OUT"/build*.log
st done
