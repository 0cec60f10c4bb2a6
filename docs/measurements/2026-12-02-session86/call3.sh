#!/usr/bin/env bash
# Session 86, call 3 (a fresh machine), on the row constructor's fix (every bf16 row load issued before any key is
# made; the router backward's saved statistics loaded before the row): build; the four main rows of E = 128, K = 8
# (whose router backward regressed in session 85), both routings back to back, 300 ms windows, for the router
# backward's stage; then the whole gtest GPU suite in two shards.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st t8
T8_MAIN="1.4B-256 7B-256 30B-512 120B-1024" T8_SWEEPS= T8_MAIN_MS=300 T8_DEADLINE_S=130 \
  bash scripts/gpu_check.sh t8 2>&1 | tail -n 6
cp "$OUT/t8_raw.txt" "$OUT/call3_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call3_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
grep -E "^\[1/1\]|router_backward" "$OUT/call3_t8_raw.txt" | sed 's/ T=.*routing=/ /; s/ rounding=.*//; s/ cache=.*//'
st gboth; bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\]" | tee "$OUT/call3_suite_summary.txt"
grep -h "FAILED" "$OUT"/gtest_g*.log | head -n 10; rm -f "$OUT"/gtest_g*.log
st done
