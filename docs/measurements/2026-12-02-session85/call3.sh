#!/usr/bin/env bash
# Session 85, call 3 (the machine of call 2, still warm, so nothing rebuilt): pytest's GPU tests on the landed kernel,
# then T8 on the E = 512 sweep row with scripts/gpu_check.sh t8 in turn (token rounding, top-K, top-K, token
# rounding; two rounds, so four run pairs; 300 ms windows), inside what was left of the session's device time.
# (Run as one command line; kept here as the record of what ran.)
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
bash scripts/ab.sh pyg 2>&1 | tail -n 2
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call3_pytest_summary.txt"
grep -E "FAILED|Error" "$OUT/pytest_gpu.log" | head -5; rm -f "$OUT/pytest_gpu.log"
echo "[$(( $(date +%s) - S ))s] t8"
T8_MAIN= T8_SWEEPS="16384:1536:256:512:8" T8_SWEEP_MS=300 T8_IN_TURN=1 T8_ROUNDS=2 \
  T8_DEADLINE_S=$(( 300 - ($(date +%s) - S) )) bash scripts/gpu_check.sh t8 2>&1 | tail -n 8
cp "$OUT/t8_raw.txt" "$OUT/call3_t8_raw.txt"; cp "$OUT/t8_table.txt" "$OUT/call3_t8_table.md"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt"
echo "[$(( $(date +%s) - S ))s] done"
