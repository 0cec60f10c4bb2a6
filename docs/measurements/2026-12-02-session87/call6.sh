#!/usr/bin/env bash
# Session 87, call 6 (2026-12-03, a fresh machine, main with load_row_slots landed): T8's rows nearest its 3 % clause,
# both routings in turn (token rounding, top-K, top-K, token rounding), three rounds, 300 ms windows: 1.4B (256,128,8),
# 7B (512,64,4) and the sweep row (16384,4096,1024,32,4).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st t8
T8_MAIN="1.4B-256 7B-512" T8_SWEEPS="16384:4096:1024:32:4" T8_IN_TURN=1 T8_ROUNDS=3 T8_MAIN_MS=300 T8_SWEEP_MS=300 \
  T8_DEADLINE_S=$(( 330 - ($(date +%s) - S) )) bash scripts/gpu_check.sh t8 2>&1 | tail -n 25
xz -9c "$OUT/t8_raw.txt" > "$OUT/call6_t8_raw.txt.xz"; cp "$OUT/t8_table.txt" "$OUT/call6_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
