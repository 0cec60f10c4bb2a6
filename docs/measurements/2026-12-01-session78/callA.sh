#!/usr/bin/env bash
# Session 78, call A (one H200): where token rounding's extra time goes on 1.4B (256,128,8). Kernel by kernel (ncu
# durations and DRAM bytes) of one forward and backward with each routing; ncu --set full of token rounding's router
# backward (tr_backward_kernel) and top-K's, with their stalls by instruction and source line.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build
MACHMOE_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-lineinfo" MACHMOE_JOBS="$(nproc)" bash scripts/build.sh 2>&1 | tail -n 1
B=./build/bin/machmoe-bench
for routing in token_rounding topk; do
  st "kernels $routing"
  ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
    $B --config 1.4B-256 --routing $routing --iters 3 --warmup 1 --warmup-ms 0 --time-ms 0 --stage-runs 1 --profile \
    > "$OUT/kernels_$routing.csv" 2>&1
  python3 scripts/ncu_kernel_times.py "$OUT/kernels_$routing.csv" | tee "$OUT/kernels_$routing.txt"
done
mkdir -p "$OUT/detail"
for k in tr_backward router_backward; do
  st "detail $k"
  routing=token_rounding; [ $k = router_backward ] && routing=topk
  o="$OUT/detail/$k"
  timeout 120 ncu --clock-control none --kernel-name-base demangled -k "regex:^$k" --launch-count 1 --set full \
    --import-source yes -f -o "$o" $B --config 1.4B-256 --routing $routing --iters 1 --warmup 0 --warmup-ms 0 \
    --time-ms 0 --stage-runs 1 > "$o.log" 2>&1
  echo "ncu exit $?"
  ncu -i "$o.ncu-rep" --print-details all > "$o.details.txt" 2>&1
  ncu -i "$o.ncu-rep" --page source --print-source sass --csv > "$o.sass.csv" 2>&1
  ncu -i "$o.ncu-rep" --page source --print-source cuda --csv > "$o.cuda.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Executed Instructions  |DRAM Throughput|Issue Slots Busy|No Eligible" "$o.details.txt" | head -14
  python3 scripts/ncu_hotspots.py "$o.sass.csv" --top 20
  python3 scripts/ncu_hotspots.py "$o.cuda.csv" --by-line --top 20
done
tar -C "$OUT" -cJf "$OUT/detail.tar.xz" detail && rm -rf "$OUT/detail"
st done
