#!/usr/bin/env bash
# Session 74, call D (one H200): the weight gradients' cooperative tile with its epilogue also staging into the
# tile's last ring stage, which the mainloop holds until the stores have read it (MACHMOE_WGRAD_BORROW=1: a
# warpgroup's whole 64 x 256 share in one round, the ring's four stages kept), against the default (four rounds in
# 16 KiB), one binary. The weight-gradient GPU tests with it on, two of them under compute-sanitizer memcheck and
# racecheck; ncu cycles of dW2 and dW1 by scripts/ncu_ab.py on four main rows; the layer on 120B (2048,64,4), A B B A.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_BORROW=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/callD_gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
for tool in memcheck racecheck; do
  MACHMOE_WGRAD_BORROW=1 MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
    ./build/tests/machmoe_gpu_tests \
    --gtest_filter='HopperWeightGrad.Dw1ShapeInterleavedAndConcatenated:HopperWeightGrad.Dw2ShapeMatchesFloat64AndTheReferenceGemm' \
    > "$OUT/callD_$tool.log" 2>&1
  echo "$tool exit $? ($(( $(date +%s) - t0 )) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/callD_$tool.log" | tr '\n' ' ')"
done
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --rounds 1 \
  --configs 120B-2048,7B-256,30B-1024,30B-256 \
  --side four --side borrow:MACHMOE_WGRAD_BORROW=1 --timeout 60 --out "$OUT/callD_ncu.csv"
echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
python3 scripts/ncu_ab.py table "$OUT/callD_ncu.csv" --labels dW2,dW1 | tee "$OUT/callD_ncu_table.md"
for d in 0 1 1 0; do
  left 540 || { echo "== skipped borrow $d: time"; continue; }
  echo "== 120B-2048 borrow $d"
  MACHMOE_WGRAD_BORROW=$d timeout 40 ./build/bin/machmoe-bench --config 120B-2048 --warmup-ms 200 \
    --time-ms 300 --stage-runs 3 2>/dev/null | grep -E "^  (forward|backward) |backward/dw[12]"
done | tee "$OUT/callD_bench.txt"
xz -f "$OUT/callD_ncu.csv" "$OUT/callD_memcheck.log" "$OUT/callD_racecheck.log"
echo "total: $(( $(date +%s) - t0 )) s"
