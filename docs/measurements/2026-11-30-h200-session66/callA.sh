#!/usr/bin/env bash
# Session 66, call A (fresh lease): the gather-sum (forward aggregation, backward dX aggregation) with a batch of
# pairs' rows in flight per thread. One machmoe-bench per version of src/gpu/aggregation_kernels.cu (scripts/ab.sh
# variants): main (one pair at a time), reg4 (a batch of 4 rows held in registers), async4 / new (8) / async16 (a batch
# of rows copied into shared memory with cp.async; the variant files are written by make_variants.sh, and the tree then
# had kGatherPairBatch = 8). ncu of the gather-sum launches (unlocked clock) on two rows, then
# the layer on four rows, 300 ms windows, round 1 all five sides, round 2 three sides in the reverse order.
set -uo pipefail
cd "$(dirname "$0")/../../.."
M=docs/measurements/2026-11-30-h200-session66
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_A.csv" 2>&1 &
SMI=$!
st build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" --target machmoe-bench >> "$OUT/build.log" 2>&1
echo "build exit $?"; cp build/bin/machmoe-bench /tmp/bench_new
st variants
VARIANT_FILE=src/gpu/aggregation_kernels.cu \
  VARIANTS="main=$M/aggregation_main.cu reg4=$M/aggregation_reg4.cu async4=$M/aggregation_async4.cu async16=$M/aggregation_async16.cu" \
  bash scripts/ab.sh variants 2>&1 | grep -E "variant|exit"
cp /tmp/bench_new build/bin/machmoe-bench
st ncu
for cfg in 1.4B-256 30B-256; do for side in main reg4 new async16; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:gather_sum" --launch-count 4 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
    "/tmp/bench_$side" --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > /tmp/ncu.txt 2>&1
  echo "-- $cfg $side rc=$?"
  grep -E "gather_sum_kernel|gpu__time|dram__bytes|registers|grid_size|warps_active" /tmp/ncu.txt | tr -s ' ' | cut -c1-110
done; done 2>&1 | tee "$OUT/ncu_gather_sum.txt"
st layer
one() {  # cfg side
  timeout 60 "/tmp/bench_$2" --config "$1" --routing topk --iters 5 --warmup 2 --stage-runs 5 --warmup-ms 300 \
    --time-ms 300 > /tmp/o.txt 2>&1
  echo "== $1 $2 rc=$? | $(grep -E '^  (forward|backward) ' /tmp/o.txt | tr -s ' ' | tr '\n' '|') agg $(grep -E 'aggregation' /tmp/o.txt | tr -s ' ' | cut -d" " -f2,3,8 | tr '\n' ' ')"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for cfg in 1.4B-256 7B-256 30B-256 120B-1024; do for side in main reg4 async4 new async16; do one $cfg $side; done; done \
  2>&1 | tee "$OUT/layer.txt"
for cfg in 1.4B-256 7B-256 30B-256 120B-1024; do for side in new async4 main; do one $cfg $side; done; done \
  2>&1 | tee -a "$OUT/layer.txt"
kill $SMI
xz -9 "$OUT/bench_raw.txt" "$OUT/clocks_A.csv"
st done
