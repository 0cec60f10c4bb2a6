#!/usr/bin/env bash
# Session 78, call G: NOT RUN (the session's device time was spent). Written for the next session's first call, on a
# checkout with dense_router_term_in_gather_sum.diff applied (git apply docs/measurements/2026-12-01-session78/
# dense_router_term_in_gather_sum.diff): the gather-sum with a dense router term, compiled here (76 registers, no
# stack, 34 KiB of shared memory) and never run. Build; its kernel tests; the layer's float64 comparisons that take it
# (token rounding, topk_softmax); then 1.4B (256,128,8) and 7B (256,128,8) with both routings (T8), where
# backward/router_gemms should drop to top-K's (dW_r alone) and backward/dx_aggregation grow a little.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st tests
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuDenseRouterGatherSum.*' 2>&1 | tail -n 12
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='AllOptions/GpuLayer.MatchesFloat64Reference/*token_rounding*:AllOptions/GpuLayer.MatchesFloat64Reference/*topk_softmax*:*SplitBackward*:*DxInChunks*:*TwoRunsAreBitwise*:*CudaGraph*:GpuEdgeShapes*' \
  2>&1 | grep -v "reference GEMM" | tail -n 6
st t8
for row in 1.4B-256 7B-256; do for routing in token_rounding topk; do
  timeout 40 ./build/bin/machmoe-bench --config $row --routing $routing --warmup-ms 300 --time-ms 300 --stage-runs 3 \
    2>/dev/null | grep -E "^config|^  (forward|backward) |router_backward|router_gemms|dx_aggregation"
done; done | tee "$OUT/callG_t8.txt"
st done
