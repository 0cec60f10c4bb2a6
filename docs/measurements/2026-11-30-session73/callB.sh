#!/usr/bin/env bash
# Session 73, call B (the 2-GPU machine): every GPU test on the weight gradients' new producer (the tree as committed
# after call A): the gtest GPU suite (two shards) on GPU 0, meanwhile pytest's one-GPU tests and then compute-sanitizer
# memcheck of four weight-gradient tests (edge tiles, strided operands, empty experts, NaN past the last routed row)
# on GPU 1; then the expert-parallel tests on both.
# (As run, its first version exported the in-tree package's variables inside GPU 1's subshell only: the
# expert-parallel step could not import machmoe, and pytest took 300 s, past memcheck's start. callC.sh ran both.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
( CUDA_VISIBLE_DEVICES=0 bash scripts/ab.sh gboth > "$OUT/gboth.txt" 2>&1 ) &
gt=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest one-GPU exit $?: $(tail -n 1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 )) s]"
  if [ $(( $(date +%s) - t0 )) -lt 300 ]; then
    MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
      ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperWeightGrad.EdgeTilesAlongMAndN:HopperWeightGrad.StridedOperandsAndOutput:HopperWeightGrad.ExpertsWithoutRowsWriteExactZerosOrStayUntouched:HopperWeightGrad.NaNPastTheLastRoutedRowDoesNotLeak' \
      > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $?: $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
  fi
) > "$OUT/gpu1.txt" 2>&1 &
g1=$!
wait $gt; wait $g1; cat "$OUT/gpu1.txt" "$OUT/gboth.txt"; echo "[$(( $(date +%s) - t0 )) s]"
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/ep_gpu.log") [$(( $(date +%s) - t0 )) s]"
grep -h "FAILED\|Failure\|error:" "$OUT"/gtest_g*.log 2>/dev/null | head -n 30
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" "$OUT/ep_gpu.log" | head -n 20
for f in "$OUT"/gtest_g*.log "$OUT"/pytest_gpu.log "$OUT"/ep_gpu.log "$OUT"/memcheck.log; do xz -f "$f"; done
echo "total [$(( $(date +%s) - t0 )) s]"
