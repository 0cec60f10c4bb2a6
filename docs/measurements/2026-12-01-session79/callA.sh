#!/usr/bin/env bash
# Session 79, call A (one H200): session 78's dense router term of dX inside the gather-sum (its diff, kept in
# ../2026-12-01-session78/, applied in this checkout) on a GPU for the first time. main's machmoe-bench first (the diff
# reverted, built, kept as /tmp/bench_main), then the diff applied and rebuilt; the new kernel's tests, the layer's
# float64 and bitwise tests in two shards, both sanitizers on the kernel's tests; then T8's rows 1.4B (256,128,8),
# 7B (256,128,8), 1.4B (512,64,4) on main and with the diff, both routings, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
export AB_PATCH=docs/measurements/2026-12-01-session78/dense_router_term_in_gather_sum.diff
bash scripts/ab.sh revert keep apply 2>&1 | grep -vE "^\[[0-9]+s\] ==" 
st tests
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuDenseRouterGatherSum.*' 2>&1 | tail -n 12
F='GpuLayer*:GpuEdgeShapes*:GpuAccumulate*'
for i in 0 1; do GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 250 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter="$F" > "$OUT/callA_layer_g$i.log" 2>&1 & done; wait
for i in 0 1; do grep -v "reference GEMM" "$OUT/callA_layer_g$i.log" | tail -n 4; done
st san
SF='GpuDenseRouterGatherSum.*' bash scripts/ab.sh san 2>&1 | grep -E "exit"
st t8
: > "$OUT/callA_t8.txt"
for row in 1.4B-256 7B-256 1.4B-512; do for side in main new; do for routing in token_rounding topk; do
  [ $(( $(date +%s) - S )) -lt 560 ] || break 3
  b=./build/bin/machmoe-bench; [ $side = main ] && b=/tmp/bench_main
  echo "== $row $side $routing" >> "$OUT/callA_t8.txt"
  timeout 40 $b --config $row --routing $routing --warmup-ms 300 --time-ms 300 --iters 10 --warmup 3 --stage-runs 3 \
    2>/dev/null | grep -E "^config|^  (forward|backward) |backward/" >> "$OUT/callA_t8.txt"
done; done; done
grep -E "^==|^  (forward|backward) |router_gemms|dx_aggregation|router_backward" "$OUT/callA_t8.txt"
st done
