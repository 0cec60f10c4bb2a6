#!/usr/bin/env bash
# Session 86, call 1 (a fresh machine): build; compute-sanitizer memcheck and racecheck on the token-rounding tests
# that take session 85's warp keys kernel (rows of more than 128 experts, K > 8, fp32 rows, rows not in whole 16-byte
# groups, and the test that a kept choice carries top-K's score); then T8 on every main row and both sweeps, both
# routings of each row back to back, 300 ms windows, stopped between rows by the call's time.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st sanitizers
F='*GpuTokenRoundingKernels*nearest_E512*:*GpuTokenRoundingKernels*up_E512_K16*:*nearest_E600*:*nearest_E128_KE*'
F="$F:*nearest_E8_KE*:*nearest_padded_rows*:*down_padded_rows_bf16_one_warp*:*T4129_E300*:*nearest_T4129_E200*"
F="$F:*ChosenPairsCarryTopKsScoresBitwise*"
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$F" > "$OUT/call1_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests from" "$OUT/call1_$tool.txt" | sort -u | tr '\n' ' ')"
done
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( 560 - ($(date +%s) - S) )) bash scripts/gpu_check.sh t8 2>&1 | tail -n 32
cp "$OUT/t8_raw.txt" "$OUT/call1_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call1_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
