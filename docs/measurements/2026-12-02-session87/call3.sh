#!/usr/bin/env bash
# Session 87, call 3 (the machine of call 2, still warm: its build with load_row_slots): the whole gtest GPU suite in
# two shards side by side, pytest's GPU tests, compute-sanitizer memcheck and racecheck on top-K's test of every kernel variant,
# the test that a kept choice carries top-K's score, token rounding's backward test and two kernel tests of its rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st gboth; bash scripts/ab.sh gboth 2>&1 | tail -n 6
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 2 > "$OUT/call3_gtest_g$i.txt"; done
grep -hE "^\[  FAILED" "$OUT"/gtest_g*.log | head; rm -f "$OUT"/gtest_g*.log
st pyg; bash scripts/ab.sh pyg 2>&1 | tail -n 2
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call3_pytest_summary.txt"
grep -E "^FAILED|Error" "$OUT/pytest_gpu.log" | head -5; rm -f "$OUT/pytest_gpu.log"
st san
F='*TopKOnTheGpuLogitsIsExactForEveryKernelVariant*:*ChosenPairsCarryTopKsScoresBitwise*'
F="$F:*GpuTokenRoundingKernels.BackwardMatchesTheReference*"
F="$F:*GpuTokenRoundingKernels*nearest_E512_K16*:*nearest_padded_rows_bf16*"
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$F" > "$OUT/call3_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests from" "$OUT/call3_$tool.txt" | sort -u | tr '\n' ' ')"
done
st done
