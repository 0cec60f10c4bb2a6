#!/usr/bin/env bash
# Session 110, call 3: T8 on the landed code (the top-K kernel writing the tile histograms, 67d2389) on the four rows
# that decide it, both routings back to back, 300 ms windows, one round: session 108's call 1 measured the same on
# the code before.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/s110; mkdir -p "$W"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
MACHMOE_JOBS=16 bash scripts/build.sh > "$W/build.log" 2>&1; st "build exit $?"
T8_MAIN='1.4B-256 7B-512' T8_SWEEPS='16384:4096:1024:256:4 16384:1536:256:512:8' T8_MAIN_MS=300 T8_SWEEP_MS=300 \
  T8_DEADLINE_S=100 OUT=$W bash scripts/gpu_check.sh t8 > "$W/t8_log.txt" 2>&1
st "t8 exit $?"
cp "$W/t8_table.txt" "$OUT/t8_table_call3.txt"; xz -c "$W/t8_raw.txt" > "$OUT/t8_raw_call3.txt.xz"
cat "$OUT/t8_table_call3.txt"
st total
