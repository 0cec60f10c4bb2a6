#!/usr/bin/env bash
# Session 87, call 4 (2026-12-03, a fresh machine; calls 2 and 3's outputs were lost when the session was cut off):
# main with row_loads_shared.diff applied. Build; compute-sanitizer racecheck on top-K's test of every kernel variant
# alone (its whole report kept: which kernels its hazards are in), then memcheck and racecheck on the other five tests
# of call 3; T8 on every main row and both sweeps, both routings back to back, 300 ms windows, with the stages that
# moved against session 86's first round (session 85's code: T8_BASE).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st san
san() {  # tool, output name, gtest filter
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool "$1" --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$3" > "$OUT/$2" 2>&1
  echo "$2: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests from" "$OUT/$2" | sort -u | tr '\n' ' ')"
}
san racecheck call4_racecheck_topk_variants.txt '*TopKOnTheGpuLogitsIsExactForEveryKernelVariant*'
grep -E "Race reported|in .*kernel|nvjet|machmoe|topk|Saved host backtrace" "$OUT/call4_racecheck_topk_variants.txt" | sort | uniq -c | sort -rn | head -20
F='*ChosenPairsCarryTopKsScoresBitwise*:*GpuTokenRoundingKernels.BackwardMatchesTheReference*'
F="$F:*GpuTokenRoundingKernels*nearest_E512_K16*:*nearest_padded_rows_bf16*"
san memcheck call4_memcheck_rest.txt "$F"
san racecheck call4_racecheck_rest.txt "$F"
xz -9 "$OUT/call4_racecheck_topk_variants.txt"
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( 545 - ($(date +%s) - S) )) \
  T8_BASE=docs/measurements/2026-12-02-session86/call1_t8_raw.txt.xz bash scripts/gpu_check.sh t8 2>&1 | tail -n 45
xz -9c "$OUT/t8_raw.txt" > "$OUT/call4_t8_raw.txt.xz"; cp "$OUT/t8_table.txt" "$OUT/call4_t8_table.md"
cp "$OUT/t8_stage_diff.txt" "$OUT/call4_t8_stage_diff.txt"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/t8_stage_diff.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
