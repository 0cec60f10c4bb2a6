#!/usr/bin/env bash
# Session 94, call 3 (main with fused_gather_sum_probe.diff applied): where the fused gather-sum's epilogue spends its time. MACHMOE_FUSED_GATHER_SUM=2: the GEMM's
# epilogue stores its rows by threads and fences them, no counters, no sums (the output is not summed: timing only);
# 3: and the counters; 1: the whole fused sum; 0: main's path (TMA stores, then the gather-sum kernel).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st bench
for cfg in 1.4B-256 30B-256; do
  for side in 0 2 3 1 1 3 2 0; do
    echo "== $cfg mode=$side"
    MACHMOE_FUSED_GATHER_SUM=$side timeout 90 ./build/bin/machmoe-bench --config $cfg --routing topk --warmup-ms 200 \
      --time-ms 200 2>&1 | grep -E "^  (forward|backward) |down_projection|aggregation|dx_expanded"
  done
done > "$OUT/call3_bench.txt" 2>&1
grep -E "==|down_projection|dx_expanded" "$OUT/call3_bench.txt"
st done
