#!/usr/bin/env bash
# Session 87, call 2 (a fresh machine): main with session 86's prepared row_loads_shared.diff applied (load_row_slots,
# one definition of the rows in registers for top-K and token rounding). Build; the top-K and token-rounding GPU tests;
# T8 on every main row and both sweeps, both routings back to back, 300 ms windows, with the stages that moved against
# session 86's first round (session 85's code: T8_BASE).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st tests
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*TopK*:*TokenRounding*:*GpuRouterKernels*:*ManyExperts*:*ManySelections*' > "$OUT/call2_tests.txt" 2>&1
echo "tests exit $? $(grep -v 'reference GEMM' "$OUT/call2_tests.txt" | tail -n 2 | tr '\n' ' ')"
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( 560 - ($(date +%s) - S) )) \
  T8_BASE=docs/measurements/2026-12-02-session86/call1_t8_raw.txt.xz bash scripts/gpu_check.sh t8 2>&1 | tail -n 60
cp "$OUT/t8_raw.txt" "$OUT/call2_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call2_t8_table.md"
cp "$OUT/t8_stage_diff.txt" "$OUT/call2_t8_stage_diff.txt"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/t8_stage_diff.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
