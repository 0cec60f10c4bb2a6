#!/usr/bin/env bash
# Session 72, call B (one H200): the weight gradients' wide tile with its output staged whole
# (Tile128x256CooperativeWholeStaging, 32 KiB a warpgroup, 3 ring stages) against the 16 KiB halves (4 stages), in one
# binary switched by MACHMOE_HOPPER_WGRAD_OUT_STAGING=16|32: the weight-gradient GPU tests (every tile), memcheck of
# the new bitwise test, then the layer on six main rows, two rounds, the two sides alternating.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/gf.txt"
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
  --gtest_brief=1 --gtest_filter='HopperWeightGrad.WholeOutputStagingIsBitwiseTheHalves' > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ')"
echo "tests: $(( $(date +%s) - t0 )) s"
run() {  # run <round> <config> <staging KiB>
  [ $(( $(date +%s) - t0 )) -gt 540 ] && { echo "== skipped $*: time"; return; }
  echo "== round $1 $2 staging $3"
  MACHMOE_HOPPER_WGRAD_OUT_STAGING=$3 ./build/bin/machmoe-bench --config "$2" --warmup-ms 200 --time-ms 200 \
    --stage-runs 1 --json "$OUT/r$1_$2_$3.json" 2>/dev/null | tee -a "$OUT/bench_full.txt" |
    grep -E "^  (forward|backward) |backward/dw[12]"
}
{
  for cfg in 120B-2048 1.4B-256 7B-256 30B-256 120B-512 30B-1024; do run 1 $cfg 16; run 1 $cfg 32; done
  for cfg in 120B-2048 1.4B-256 7B-256 30B-256 120B-512 30B-1024; do run 2 $cfg 32; run 2 $cfg 16; done
} 2>&1 | tee "$OUT/bench.txt"
xz -f "$OUT/bench_full.txt" "$OUT/memcheck.log" 2>/dev/null
cd "$OUT" && tar -cJf jsons.tar.xz r*.json && rm -f r*.json
echo "total: $(( $(date +%s) - t0 )) s"
