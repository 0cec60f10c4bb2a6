#!/usr/bin/env bash
# Session 75, call C (the 2-GPU H200, warm from call B, whose build/ holds this tree's objects): the expert-parallel
# tests on both GPUs; then every main row on the landed code (top-K, 300 ms windows), the recompute cache mode on
# GPU 0 and the default one on GPU 1 at the same time.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
t0=$(date +%s)
touch $(grep '^+++ b/' docs/measurements/2026-11-30-session74/borrow_stage_v2.diff | cut -c7-)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/callC_ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/callC_ep_gpu.log") [$(( $(date +%s) - t0 )) s]"
grep -E "^(FAILED|ERROR)" "$OUT/callC_ep_gpu.log" | head -n 20
for g in 0 1; do
  cache=input_only; [ $g = 1 ] && cache=preact
  CUDA_VISIBLE_DEVICES=$g timeout 240 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache \
    --warmup-ms 300 --time-ms 300 --json "$OUT/callC_all_$cache.json" > "$OUT/callC_all_$cache.txt" 2>&1 &
done
wait
echo "all rows done [$(( $(date +%s) - t0 )) s]"
for c in input_only preact; do echo "== $c"; grep -E "^  (forward|backward) " "$OUT/callC_all_$c.txt"; done
xz -f "$OUT"/callC_*.log "$OUT"/callC_all_*.txt
echo "total [$(( $(date +%s) - t0 )) s]"
