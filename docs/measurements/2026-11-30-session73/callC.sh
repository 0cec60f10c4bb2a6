#!/usr/bin/env bash
# Session 73, call C (the 2-GPU machine, warm after call B, its build kept): what call B missed, the expert-parallel
# tests on one and two GPUs, and meanwhile nothing else; then compute-sanitizer memcheck of four weight-gradient tests.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 1
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/ep_gpu.log") [$(( $(date +%s) - t0 )) s]"
grep -E "^(FAILED|ERROR)" "$OUT/ep_gpu.log" | head -n 20
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 250 compute-sanitizer --tool memcheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='HopperWeightGrad.EdgeTilesAlongMAndN:HopperWeightGrad.StridedOperandsAndOutput:HopperWeightGrad.ExpertsWithoutRowsWriteExactZerosOrStayUntouched:HopperWeightGrad.NaNPastTheLastRoutedRowDoesNotLeak' \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?: $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
for f in "$OUT"/ep_gpu.log "$OUT"/memcheck.log; do xz -f "$f"; done
echo "total [$(( $(date +%s) - t0 )) s]"
