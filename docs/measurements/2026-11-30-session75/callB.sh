#!/usr/bin/env bash
# Session 75, call B (the 2-GPU H200): the whole GPU suite on the borrowed-stage weight-gradient epilogue as landed
# (borrow_stage_v2.diff committed): the gtest GPU suite in two shards on GPU 0, then compute-sanitizer racecheck of
# weight-gradient tests there; meanwhile pytest's one-GPU tests and then memcheck of the same tests on GPU 1. (The
# expert-parallel tests, which need both GPUs, run in call C.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
t0=$(date +%s)
touch $(grep '^+++ b/' docs/measurements/2026-11-30-session74/borrow_stage_v2.diff | cut -c7-)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
wg='HopperWeightGrad.EdgeTilesAlongMAndN:HopperWeightGrad.ExpertsWithoutRowsWriteExactZerosOrStayUntouched:HopperWeightGrad.Dw1ShapeInterleavedAndConcatenated'
san() {  # tool, seconds
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 9 \
    ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$wg" > "$OUT/callB_$1.log" 2>&1
  echo "$1 exit $?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/callB_$1.log" | sort -u | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
}
(
  export CUDA_VISIBLE_DEVICES=0
  bash scripts/ab.sh gboth
  left=$(( 560 - ($(date +%s) - t0) ))
  [ "$left" -gt 30 ] && san racecheck "$left" || echo "racecheck skipped: time"
) > "$OUT/callB_gpu0.txt" 2>&1 &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python > "$OUT/callB_pytest_gpu.log" 2>&1
  echo "pytest one-GPU exit $?: $(tail -n 1 "$OUT/callB_pytest_gpu.log") [$(( $(date +%s) - t0 )) s]"
  san memcheck 100
) > "$OUT/callB_gpu1.txt" 2>&1 &
g1=$!
wait $g0 $g1
cat "$OUT/callB_gpu0.txt" "$OUT/callB_gpu1.txt"
for i in 0 1; do mv "$OUT/gtest_g$i.log" "$OUT/callB_gtest_g$i.log" 2>/dev/null; done
grep -h "FAILED\|Failure\|error:" "$OUT"/callB_gtest_g*.log 2>/dev/null | head -n 30
grep -E "^(FAILED|ERROR)" "$OUT/callB_pytest_gpu.log" | head -n 20
xz -f "$OUT"/callB_*.log
echo "total [$(( $(date +%s) - t0 )) s]"
