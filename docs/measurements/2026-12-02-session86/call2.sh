#!/usr/bin/env bash
# Session 86, call 2 (the machine of call 1, still warm, so nothing rebuilt; typed at the tool as one command line,
# kept here as the record of what ran): T8 on the two main rows where call 1's back-to-back pair had token rounding
# slowest, 1.4B (256,128,8) and 7B (512,64,4), in turn (token rounding, top-K, top-K, token rounding), three rounds:
# six run pairs each, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
T8_MAIN="1.4B-256 7B-512" T8_SWEEPS= T8_MAIN_MS=300 T8_IN_TURN=1 T8_ROUNDS=3 T8_DEADLINE_S=400 \
  bash scripts/gpu_check.sh t8 2>&1 | tail -n 8
cp "$OUT/t8_raw.txt" "$OUT/call2_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call2_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt"
echo "[$(( $(date +%s) - S ))s] done"
