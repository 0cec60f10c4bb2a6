#!/usr/bin/env bash
# Session 76, call A (one H200): build main, run session 75's unrun weight-gradient test
# (HopperWeightGrad.BorrowedStageOnEdgeTilesOfMoreThanHalfATile) with the other weight-gradient tests, then ncu --set
# full of the dH kernel (one launch each) on 120B (2048,64,4) (128 x 256 cooperative tile) and 7B (256,128,8)
# (128 x 128 ping-pong), with the SASS page's stall samples ranked (scripts/ncu_hotspots.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperWeightGrad*:ReferenceWeightGrad*' \
  > "$OUT/callA_wgrad_tests.log" 2>&1
echo "wgrad tests exit $?: $(grep -v "reference GEMM" "$OUT/callA_wgrad_tests.log" | tail -n 2 | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
grep -c "OK \]\|^\[       OK" "$OUT/callA_wgrad_tests.log"
grep -B2 -A12 "Failure" "$OUT/callA_wgrad_tests.log" | head -n 40
./build/tests/machmoe_gpu_tests --gtest_filter='HopperWeightGrad.BorrowedStageOnEdgeTilesOfMoreThanHalfATile' 2>&1 | grep -E "^\[" | tail -n 4
mkdir -p "$OUT/detail"
for cfg in 120B-2048 7B-256; do
  out="$OUT/detail/dh_$cfg"
  timeout 150 ncu --clock-control none --kernel-name-base demangled -k "regex:EpilogueActivationGrad" --launch-count 1 \
    --set full --import-source yes -f -o "$out" ./build/bin/machmoe-bench --config $cfg --iters 1 --warmup 0 > "$out.log" 2>&1
  echo "== $cfg: ncu exit $? [$(( $(date +%s) - t0 )) s]"
  ncu -i "$out.ncu-rep" --print-details all > "$out.details.txt" 2>&1
  ncu -i "$out.ncu-rep" --page source --print-source sass --csv > "$out.sass.csv" 2>&1
  grep -E "Duration|SM Frequency|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|L2 Hit|Memory Throughput" "$out.details.txt" | head -12
  python3 scripts/ncu_hotspots.py "$out.sass.csv" --top 30
  python3 scripts/ncu_hotspots.py "$out.sass.csv" --barriers --top 8
  xz -f "$out.sass.csv"
done
rm -f "$OUT"/detail/*.ncu-rep
tar -C "$OUT" -cJf "$OUT/callA_detail.tar.xz" detail && rm -rf "$OUT/detail"
xz -f "$OUT"/callA_*.log
echo "total [$(( $(date +%s) - t0 )) s]"
