#!/usr/bin/env bash
# Session 88, call 1 (2026-12-03, a fresh machine): token rounding's router term of dX from the rerouted tokens' rows.
# Build; registers and stack of the router backward's kernels and the rerouted rows' kernel; the token-rounding GPU
# tests (kernels and layer, with the new ones); compute-sanitizer memcheck and racecheck on the two new kernel tests;
# T8 on every main row and both sweeps, both routings back to back, 300 ms windows, with the stages that moved against
# session 87's full round (T8_BASE).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
cuobjdump --dump-resource-usage build/CMakeFiles/machmoe.dir/src/gpu/token_rounding_kernels.cu.o 2>&1 |
  grep -A1 -E "tr_backward_kernel|rerouted_rows_kernel" | grep -oE "Function [^ :]+|REG:[0-9]+ STACK:[0-9]+" |
  paste - - | c++filt 2>/dev/null | sed -E 's/\(.*\)//' > "$OUT/call1_registers.txt" || true
head -n 30 "$OUT/call1_registers.txt"
st gf
F='*GpuTokenRounding*:*TokenRounding*:*token_rounding*:*ManyExperts*'
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 240 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" \
  > "$OUT/call1_gf.txt" 2>&1
echo "gf exit $?"; grep -v "reference GEMM" "$OUT/call1_gf.txt" | grep -E "^\[  FAILED|PASSED|FAILED TEST|tests? ran" | head -20
st san
san() {  # tool, output name, gtest filter
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 100 compute-sanitizer --tool "$1" --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$3" > "$OUT/$2" 2>&1
  echo "$2: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests from" "$OUT/$2" | sort -u | tr '\n' ' ')"
}
F='*BackwardPairTermsCarryEachUnreroutedTokensGradient*:*ReroutedRowsListTheFlaggedTokensInOrder*'
san memcheck call1_memcheck.txt "$F"
san racecheck call1_racecheck.txt "$F"
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( 560 - ($(date +%s) - S) )) \
  T8_BASE=docs/measurements/2026-12-02-session87/call4_t8_raw.txt.xz bash scripts/gpu_check.sh t8 2>&1 | tail -n 45
xz -9c "$OUT/t8_raw.txt" > "$OUT/call1_t8_raw.txt.xz"; cp "$OUT/t8_table.txt" "$OUT/call1_t8_table.md"
cp "$OUT/t8_stage_diff.txt" "$OUT/call1_t8_stage_diff.txt"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/t8_stage_diff.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
