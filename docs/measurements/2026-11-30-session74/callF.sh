#!/usr/bin/env bash
# Session 74, call F (the 2-GPU H200, warm from call E, whose build/ holds this tree's objects): every GPU test on
# the borrowed-stage epilogue: the gtest GPU suite (two shards) on GPU 0, meanwhile pytest's one-GPU tests and then
# compute-sanitizer memcheck and racecheck of weight-gradient tests on GPU 1; then the expert-parallel tests on both.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
( CUDA_VISIBLE_DEVICES=0 bash scripts/ab.sh gboth > "$OUT/callF_gboth.txt" 2>&1 ) &
gt=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python > "$OUT/callF_pytest_gpu.log" 2>&1
  echo "pytest one-GPU exit $?: $(tail -n 1 "$OUT/callF_pytest_gpu.log") [$(( $(date +%s) - t0 )) s]"
  for tool in memcheck racecheck; do
    [ $(( $(date +%s) - t0 )) -lt 330 ] || { echo "$tool skipped: time"; continue; }
    MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 \
      ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperWeightGrad.EdgeTilesAlongMAndN:HopperWeightGrad.ExpertsWithoutRowsWriteExactZerosOrStayUntouched:HopperWeightGrad.Dw1ShapeInterleavedAndConcatenated' \
      > "$OUT/callF_$tool.log" 2>&1
    echo "$tool exit $?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/callF_$tool.log" | sort -u | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
  done
) > "$OUT/callF_gpu1.txt" 2>&1 &
g1=$!
wait $gt; wait $g1; cat "$OUT/callF_gpu1.txt" "$OUT/callF_gboth.txt"; echo "[$(( $(date +%s) - t0 )) s]"
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/callF_ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/callF_ep_gpu.log") [$(( $(date +%s) - t0 )) s]"
grep -h "FAILED\|Failure\|error:" "$OUT"/gtest_g*.log 2>/dev/null | head -n 30
grep -E "^(FAILED|ERROR)" "$OUT/callF_pytest_gpu.log" "$OUT/callF_ep_gpu.log" | head -n 20
for f in "$OUT"/gtest_g*.log "$OUT"/callF_pytest_gpu.log "$OUT"/callF_ep_gpu.log "$OUT"/callF_memcheck.log "$OUT"/callF_racecheck.log; do
  [ -f "$f" ] && xz -f "$f"
done
echo "total [$(( $(date +%s) - t0 )) s]"
