#!/usr/bin/env bash
# Session 82, call D: where token rounding's routing kernels wait on the small-E rows, where its stage is 1.6-2.0x
# top-K's: ncu --set full (unlocked clocks) of one forward's keys, bounded select and emit on 1.4B (1024,32,2) and
# (256,128,8), with the instructions and source lines where their warps stall (scripts/gpu_check.sh detail: its own
# -lineinfo build).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
KERNEL_REGEX='tr_(keys_lane|select_bounded|emit)' LAUNCHES=3 BENCH_CONFIGS="1.4B-1024 1.4B-256" \
  BENCH_ARGS="--routing token_rounding" DETAIL_TIMEOUT=120 \
  bash scripts/gpu_check.sh detail 2>&1 | grep -v "HGMMA instructions" | tee "$OUT/callD_detail.txt" | tail -n 150
ls "$OUT"
echo "[$(( $(date +%s) - S ))s] done"
