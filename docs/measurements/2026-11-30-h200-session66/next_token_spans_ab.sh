#!/usr/bin/env bash
# Written in session 66 and not run: the A/B that gather_sum_token_spans.diff needs (see this folder's README).
# One device call on a fresh lease, about 6 minutes: machmoe-bench of this checkout ("new" = main) and of main with the
# diff applied to src/gpu/aggregation_kernels.cu ("spans", scripts/ab.sh variants); ncu of the gather-sum launches on a
# K = 2 row and a K = 8 row; the layer on two K = 2 rows and one K = 8 row, two rounds, 300 ms windows, the order
# alternating; everything packed (a device call returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../../.."
M=docs/measurements/2026-11-30-h200-session66
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp src/gpu/aggregation_kernels.cu /tmp/aggregation_spans.cu
patch -s /tmp/aggregation_spans.cu "$M/gather_sum_token_spans.diff" || { echo "the diff does not apply"; exit 3; }
st build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" --target machmoe-bench >> "$OUT/build.log" 2>&1
echo "build exit $?"; cp build/bin/machmoe-bench /tmp/bench_new
VARIANT_FILE=src/gpu/aggregation_kernels.cu VARIANTS="spans=/tmp/aggregation_spans.cu" bash scripts/ab.sh variants |
  grep -E "variant|exit"
cp /tmp/bench_new build/bin/machmoe-bench
st ncu
for cfg in 1.4B-1024 1.4B-256; do for side in new spans; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:gather_sum" --launch-count 4 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
    "/tmp/bench_$side" --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > /tmp/ncu.txt 2>&1
  echo "-- $cfg $side rc=$?"
  grep -E "gather_sum_kernel|gpu__time|dram__|registers|grid_size|warps_active" /tmp/ncu.txt | tr -s ' ' | cut -c1-120
done; done > "$OUT/ncu_gather_sum.txt" 2>&1
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
bash scripts/ab.sh pack
st done
