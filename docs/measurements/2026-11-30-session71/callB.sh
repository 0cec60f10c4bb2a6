#!/usr/bin/env bash
# Session 71, call B (the 2-GPU machine): every GPU test on the final code. The gtest GPU suite (two shards) on
# GPU 0, meanwhile pytest's one-GPU tests on GPU 1 and then the expert-parallel tests on both.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
bash scripts/ab.sh build 2>&1 | tail -n 2
( CUDA_VISIBLE_DEVICES=0 bash scripts/ab.sh gboth > "$OUT/gboth.txt" 2>&1 ) &
gt=$!
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest one-GPU exit $?: $(tail -n 1 "$OUT/pytest_gpu.log")"
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/ep_gpu.log")"
wait $gt; cat "$OUT/gboth.txt"
grep -h "FAILED\|Failure\|error:" "$OUT"/gtest_g*.log | head -n 30
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" "$OUT/ep_gpu.log" | head -n 20
for f in "$OUT"/gtest_g*.log "$OUT"/pytest_gpu.log "$OUT"/ep_gpu.log; do xz -f "$f"; done
