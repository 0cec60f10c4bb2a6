#!/usr/bin/env bash
# Session 87, call 5 (2026-12-03, the machine of call 4, still warm: its build with load_row_slots): the whole gtest
# GPU suite in two shards side by side, then pytest's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st gboth; bash scripts/ab.sh gboth 2>&1 | tail -n 6
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 2 > "$OUT/call5_gtest_g$i.txt"; done
grep -hE "^\[  FAILED" "$OUT"/gtest_g*.log | head; rm -f "$OUT"/gtest_g*.log "$OUT/build.log"
st pyg; bash scripts/ab.sh pyg 2>&1 | tail -n 2
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call5_pytest_summary.txt"
grep -E "^FAILED|Error" "$OUT/pytest_gpu.log" | head -5; rm -f "$OUT/pytest_gpu.log"
st done
