#!/usr/bin/env bash
# Session 86, call 4 (the machine of call 3, still warm: its build of the fix): pytest's GPU tests; compute-sanitizer
# memcheck and racecheck on token rounding's backward test and kernel tests whose rows take the changed constructor
# (E = 128 K = 8, E = 512 K = 16, bf16 rows with padding, the chosen pairs' scores); then T8 on the E = 512 sweep row
# in turn (token rounding, top-K, top-K, token rounding), two rounds: four run pairs, 300 ms windows. (Typed at the
# tool as one command line; kept here as the record of what ran.)
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
bash scripts/ab.sh pyg 2>&1 | tail -n 2
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call4_pytest_summary.txt"
grep -E "^FAILED|Error" "$OUT/pytest_gpu.log" | head -5; rm -f "$OUT/pytest_gpu.log"
echo "[$(( $(date +%s) - S ))s] san"
F='*GpuTokenRoundingKernels.BackwardMatchesTheReference*:*GpuTokenRoundingKernels*nearest_E128_K8*'
F="$F:*GpuTokenRoundingKernels*nearest_E512_K16*:*nearest_padded_rows_bf16*:*ChosenPairsCarryTopKsScoresBitwise*"
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$F" > "$OUT/call4_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests from" "$OUT/call4_$tool.txt" | sort -u | tr '\n' ' ')"
done
echo "[$(( $(date +%s) - S ))s] t8"
T8_MAIN= T8_SWEEPS="16384:1536:256:512:8" T8_SWEEP_MS=300 T8_IN_TURN=1 T8_ROUNDS=2 \
  T8_DEADLINE_S=$(( 400 - ($(date +%s) - S) )) bash scripts/gpu_check.sh t8 2>&1 | tail -n 5
cp "$OUT/t8_raw.txt" "$OUT/call4_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call4_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt"
echo "[$(( $(date +%s) - S ))s] done"
