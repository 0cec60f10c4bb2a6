#!/usr/bin/env bash
# Session 107, call 6, prepared and not run (its two tries found no machine; the landed code): T8 on the rows that decide it, both routings back to back,
# 300 ms windows: the sweep row of its 1.15x clause (16384,4096,1024,256,4), the E = 512 sweep row of its routing-stage
# clause, and the two main rows nearest its 3 % clause in s87 (1.4B (256,128,8), 7B (512,64,4)). Only these: a start
# that found no machine had left the session 378 s of device time. scripts/gpu_check.sh t8 builds first and stops
# between rows once T8_DEADLINE_S has passed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
T8_MAIN='1.4B-256 7B-512' T8_SWEEPS='16384:4096:1024:256:4 16384:1536:256:512:8' \
  T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=100 bash scripts/gpu_check.sh t8 > "$OUT/t8_log_call6.txt" 2>&1
st "t8 exit $?"
xz -9c "$OUT/t8_raw.txt" > "$OUT/t8_raw_call6.txt.xz"; mv "$OUT/t8_table.txt" "$OUT/t8_table_call6.md"
mv "$OUT/gpu.txt" "$OUT/gpu_call6.txt"; rm -f "$OUT/t8_raw.txt" "$OUT/hopper_kernels.txt"
cat "$OUT/gpu_call6.txt" "$OUT/t8_table_call6.md"; grep -E "past T8_DEADLINE|gpu_check:" "$OUT/t8_log_call6.txt"
st total
