#!/usr/bin/env bash
# Prepared in session 88 for the next session's first device call (a fresh machine): top-K's router term of dX in
# dX~'s epilogue with its operands fetched before the mainloop (router_term_prefetched.diff, applied to the checkout
# before this call: `git apply docs/measurements/2026-12-03-session88-prepared/router_term_prefetched.diff`).
# Build; registers and stack of the store kernels; the router-term tests; T8 on every main row and both sweeps, one
# round, 300 ms windows, with the stages that moved against session 88's unprefetched version (call 3) and session
# 87's landed code (call 4).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
pre=calla  # this call's output files: $OUT/${pre}_*
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git diff --quiet -- src/gpu/hopper/epilogue_store.cuh && { echo "calla: the diff is not applied"; exit 2; }
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
for f in build/CMakeFiles/machmoe.dir/src/gpu/hopper/instantiations/{bwd_dx,down}*.cu.o; do
  echo "$(basename "$f"): $(cuobjdump --dump-resource-usage "$f" 2>&1 | grep -o 'REG:[0-9]* STACK:[0-9]* SHARED:[0-9]*' | sort -u | tr '\n' ' ')"
done | tee "$OUT/${pre}_store_kernels.txt"
st gf
F='*RouterTermInDxEpilogue*:*DxInChunksOfTokens*:*TwoRunsAreBitwise*:*ManySelectionsPerToken*:*HopperShapes*topk*input_only*'
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" \
  > "$OUT/${pre}_gf.txt" 2>&1
echo "gf exit $?"; grep -v "reference GEMM" "$OUT/${pre}_gf.txt" | grep -E "^\[  FAILED|PASSED|FAILED TEST|tests? ran" | head -20
st t8
T8_MAIN_MS=300 T8_SWEEP_MS=300 T8_DEADLINE_S=$(( 560 - ($(date +%s) - S) )) \
  T8_BASE="docs/measurements/2026-12-03-session88/call3_t8_raw.txt.xz" bash scripts/gpu_check.sh t8 2>&1 | tail -n 30
python3 scripts/stage_diff.py docs/measurements/2026-12-02-session87/call4_t8_raw.txt.xz -- "$OUT/t8_raw.txt" \
  > "$OUT/${pre}_t8_stage_diff_s87.txt"
xz -9c "$OUT/t8_raw.txt" > "$OUT/${pre}_t8_raw.txt.xz"; cp "$OUT/t8_table.txt" "$OUT/${pre}_t8_table.txt"
cp "$OUT/t8_stage_diff.txt" "$OUT/${pre}_t8_stage_diff_s88.txt"
rm -f "$OUT/t8_raw.txt" "$OUT/t8_table.txt" "$OUT/t8_stage_diff.txt" "$OUT/gpu.txt" "$OUT/hopper_kernels.txt" "$OUT/build.log"
st done
