#!/usr/bin/env bash
# Session 88, call 3 (the machine of call 2, still warm: its build): pytest's GPU tests, then T8 on every main row and
# the sweep rows whose time allows, both routings back to back, 300 ms windows, with the stages that moved against
# session 87's full round (T8_BASE).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st pyg; bash scripts/ab.sh pyg 2>&1 | tail -n 2
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call3_pytest_summary.txt"
grep -E "^FAILED|Error" "$OUT/pytest_gpu.log" | head -5; rm -f "$OUT/pytest_gpu.log"
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( ${CALL3_END_S:-560} - ($(date +%s) - S) )) \
  T8_BASE=docs/measurements/2026-12-02-session87/call4_t8_raw.txt.xz bash scripts/gpu_check.sh t8 2>&1 | tail -n 60
xz -9c "$OUT/t8_raw.txt" > "$OUT/call3_t8_raw.txt.xz"; cp "$OUT/t8_table.txt" "$OUT/call3_t8_table.md"
cp "$OUT/t8_stage_diff.txt" "$OUT/call3_t8_stage_diff.txt"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/t8_stage_diff.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
