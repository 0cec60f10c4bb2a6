#!/usr/bin/env bash
# Session 88, call 2 (2026-12-03, a fresh machine): the router's term of dX in dX~'s epilogue (a rank-one update
# per tile) in place of the gather-sum's pair terms. Build; registers and stack of the store kernels; the tests of
# the router term first; then the whole gtest GPU suite in two shards side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
for f in build/CMakeFiles/machmoe.dir/src/gpu/hopper/instantiations/{bwd_dx,down}*.cu.o; do
  echo "$(basename "$f"): $(cuobjdump --dump-resource-usage "$f" 2>&1 | grep -o 'REG:[0-9]* STACK:[0-9]*' | sort -u | tr '\n' ' ')"
done | tee "$OUT/call2_store_kernels.txt"
st gf
F='*RouterTermInDxEpilogue*:*DxInChunksOfTokens*:*TwoRunsAreBitwise*:*ManySelectionsPerToken*:*HopperShapes*topk*input_only*'
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" \
  > "$OUT/call2_gf.txt" 2>&1
echo "gf exit $?"; grep -v "reference GEMM" "$OUT/call2_gf.txt" | grep -E "^\[  FAILED|PASSED|FAILED TEST|tests? ran" | head -20
st gboth; bash scripts/ab.sh gboth 2>&1 | tail -n 6
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 2 > "$OUT/call2_gtest_g$i.txt"; done
grep -hE "^\[  FAILED" "$OUT"/gtest_g*.log | head; rm -f "$OUT"/gtest_g*.log "$OUT/build.log"
st done
