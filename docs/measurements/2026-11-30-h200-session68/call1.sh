#!/usr/bin/env bash
# Session 68, call 1 (fresh lease): the tree holds session 67's caller_pairs_and_topk_race.diff (uncommitted).
# Full build (with the PyTorch operators), the caller-routing and top-K tests it touches, then session 66's
# gather_sum_token_spans.diff as a variant of aggregation_kernels.cu against this tree: ncu of the gather-sum on a
# K = 2 row, and the layer on two K = 2 rows and one K = 8 row, two rounds, order alternating, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build | grep -E "exit|error" | head -5
st targeted
F='*MalformedCallerPairs*:*OutOfRangeCallerPairs*:*TopKOnTheGpuLogits*:*HopperKernelsAgree*:*IndexCheck*:*Caller*:*GpuTokenRoundingKernels*MatchTheReference*'
./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" > "$OUT/targeted.log" 2>&1
echo "targeted exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/targeted.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/targeted.log" | head -10
st variants
cp build/bin/machmoe-bench /tmp/bench_new
cp src/gpu/aggregation_kernels.cu /tmp/aggregation_spans.cu
patch -s /tmp/aggregation_spans.cu docs/measurements/2026-11-30-h200-session66/gather_sum_token_spans.diff || echo "spans diff does not apply"
VARIANT_FILE=src/gpu/aggregation_kernels.cu VARIANTS="spans=/tmp/aggregation_spans.cu" bash scripts/ab.sh variants | grep -E "variant|exit"
st ncu
for side in new spans; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:gather_sum" --launch-count 4 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size \
    "/tmp/bench_$side" --config 1.4B-1024 --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > /tmp/ncu.txt 2>&1
  echo "-- 1.4B-1024 $side rc=$?"; grep -E "gather_sum|gpu__time|dram__|registers|grid_size" /tmp/ncu.txt | tr -s ' ' | cut -c1-140
done > "$OUT/ncu_gather_sum.txt" 2>&1
st layer
for r in 1 2; do for cfg in 1.4B-1024 7B-1024 1.4B-256; do
  order="new spans"; [ $r = 2 ] && order="spans new"
  for side in $order; do
    timeout 60 "/tmp/bench_$side" --config $cfg --routing topk --iters 5 --warmup 2 --stage-runs 5 --warmup-ms 300 \
      --time-ms 300 > /tmp/o.txt 2>&1
    echo "== $cfg $side r$r rc=$? | $(grep -E '^  (forward|backward) ' /tmp/o.txt | tr -s ' ' | tr '\n' '|') agg $(grep -E 'aggregation' /tmp/o.txt | tr -s ' ' | cut -d' ' -f2,3,8 | tr '\n' ' ')"
    cat /tmp/o.txt >> "$OUT/bench_raw.txt"
  done
done; done 2>&1 | tee "$OUT/layer.txt"
xz -9 "$OUT/bench_raw.txt"
st done
bash scripts/ab.sh pack > /dev/null
