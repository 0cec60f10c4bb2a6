#!/usr/bin/env bash
# Session 76, call D (the same H200, warm): T8's two token-rounding sweeps, both routings of each row back to back
# (500 ms windows, as scripts/gpu_check.sh t8 runs them).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
: > "$OUT/callD_t8_sweeps_raw.txt"
for row in 16384:1536:256:64:8 16384:1536:256:128:8 16384:1536:256:256:8 16384:1536:256:512:8 16384:4096:1024:32:4 \
           16384:4096:1024:64:4 16384:4096:1024:128:4 16384:4096:1024:256:4; do
  IFS=: read -r t d n e k <<< "$row"
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --T $t --d $d --n $n --E $e --K $k --warmup-ms 500 --time-ms 500 \
      --routing "$routing" --iters 10 --warmup 3 --stage-runs 3 >> "$OUT/callD_t8_sweeps_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callD_t8_sweeps_raw.txt" > "$OUT/callD_t8_sweeps_table.md" 2>&1
cat "$OUT/callD_t8_sweeps_table.md"; xz -f "$OUT/callD_t8_sweeps_raw.txt"
echo "[$(( $(date +%s) - S ))s] done"
