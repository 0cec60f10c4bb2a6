#!/usr/bin/env bash
# Session 78, call B (one H200): call A's ncu --set full again with regexes that match ncu's demangled names
# (machmoe::gpu::<unnamed>::...): token rounding's router backward (tr_backward_kernel), top-K's
# (router_backward_kernel), and token rounding's forward kernels, one launch each on 1.4B (256,128,8), with their
# stalls by instruction and source line.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build
MACHMOE_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-lineinfo" MACHMOE_JOBS="$(nproc)" bash scripts/build.sh 2>&1 | tail -n 1
B=./build/bin/machmoe-bench
mkdir -p "$OUT/detail"
for k in tr_backward_kernel router_backward_kernel tr_keys_kernel tr_select_bounded_kernel tr_emit_kernel; do
  st "detail $k"
  routing=token_rounding; [ $k = router_backward_kernel ] && routing=topk
  o="$OUT/detail/$k"
  timeout 120 ncu --clock-control none --kernel-name-base demangled -k "regex:$k" --launch-count 1 --set full \
    --import-source yes -f -o "$o" $B --config 1.4B-256 --routing $routing --iters 1 --warmup 0 --warmup-ms 0 \
    --time-ms 0 --stage-runs 1 > "$o.log" 2>&1
  echo "ncu exit $?"
  ncu -i "$o.ncu-rep" --print-details all > "$o.details.txt" 2>&1
  ncu -i "$o.ncu-rep" --page source --print-source sass --csv > "$o.sass.csv" 2>&1
  ncu -i "$o.ncu-rep" --page source --print-source cuda --csv > "$o.cuda.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Executed Instructions  |DRAM Throughput|Issue Slots Busy|No Eligible" "$o.details.txt" | head -14
  python3 scripts/ncu_hotspots.py "$o.sass.csv" --top 16
  python3 scripts/ncu_hotspots.py "$o.cuda.csv" --by-line --top 16
done
tar -C "$OUT" -cJf "$OUT/detail.tar.xz" detail && rm -rf "$OUT/detail"
st done
