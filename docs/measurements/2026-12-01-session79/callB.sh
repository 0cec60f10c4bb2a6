#!/usr/bin/env bash
# Session 79, call B (one H200): the dense router term's gather-sum rewritten after call A showed it at 0.40 of copy
# bandwidth (dx_aggregation 0.148 -> 0.335 ms on 1.4B (256,128,8)): the product's operands by cp.async and ldmatrix,
# each thread streaming its rows' pairs through two cp.async batches, the first under the product. Three versions of
# src/gpu/gather_sum_dense_router.cu: v1 (session 78's, the one call A ran), v4 (this checkout's: batches of 4 pairs,
# three CTAs an SM) and v8 (batches of 8, two CTAs an SM). Build; v4's tests; ncu of the kernel in each version and
# of the plain gather-sum (top-K); T8's small rows with each version's token rounding and top-K.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/gather_sum_dense_router.cu \
  VARIANTS="v1=third_party/variants/dense_v1.cu v8=third_party/variants/dense_v8.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_v4
st tests
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuDenseRouterGatherSum.*' 2>&1 | tail -n 4
F='GpuLayer*:GpuEdgeShapes*:GpuAccumulate*'
for i in 0 1; do GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 250 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter="$F" > "$OUT/callB_layer_g$i.log" 2>&1 & done; wait
for i in 0 1; do grep -v "reference GEMM" "$OUT/callB_layer_g$i.log" | tail -n 2; done
SF='GpuDenseRouterGatherSum.*' bash scripts/ab.sh san 2>&1 | grep -E "exit"
st ncu
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct
for v in v1 v4 v8; do
  echo "-- $v" 
  timeout 60 ncu --clock-control none -k regex:gather_sum_dense --launch-count 1 --metrics $M /tmp/bench_$v --config 1.4B-256 \
    --routing token_rounding --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 2>&1 | grep -E "^    [a-z]" 
done | tee "$OUT/callB_ncu.txt"
echo "-- plain gather_sum, top-K backward (second launch: dX)" | tee -a "$OUT/callB_ncu.txt"
timeout 60 ncu --clock-control none -k regex:gather_sum_kernel --launch-skip 1 --launch-count 1 --metrics $M /tmp/bench_v4 \
  --config 1.4B-256 --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 2>&1 |
  grep -E "^    [a-z]" | tee -a "$OUT/callB_ncu.txt"
st t8
: > "$OUT/callB_t8.txt"
for row in 1.4B-256 7B-256 1.4B-512 1.4B-1024; do for run in v4:token_rounding v8:token_rounding v4:topk; do
  [ $(( $(date +%s) - S )) -lt 560 ] || break 2
  v=${run%%:*}; routing=${run#*:}
  echo "== $row $v $routing" >> "$OUT/callB_t8.txt"
  timeout 40 /tmp/bench_$v --config $row --routing $routing --warmup-ms 300 --time-ms 300 --iters 10 --warmup 3 --stage-runs 3 \
    2>/dev/null | grep -E "^config|^  (forward|backward) |backward/" >> "$OUT/callB_t8.txt"
done; done
grep -E "^==|^  backward |router_gemms|dx_aggregation" "$OUT/callB_t8.txt"
st done
