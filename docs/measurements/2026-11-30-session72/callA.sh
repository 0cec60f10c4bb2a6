#!/usr/bin/env bash
# Session 72, call A (the 2-GPU machine): every GPU test on main as session 71 left it (c58b553), whose last GPU run was
# cut short: the gtest GPU suite (two shards) on GPU 0, meanwhile pytest's one-GPU tests on GPU 1, then the
# expert-parallel tests on both; then one machmoe-bench --json run to check the fields session 71 added.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
( CUDA_VISIBLE_DEVICES=0 bash scripts/ab.sh gboth > "$OUT/gboth.txt" 2>&1 ) &
gt=$!
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
CUDA_VISIBLE_DEVICES=1 timeout 360 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest one-GPU exit $?: $(tail -n 1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 )) s]"
wait $gt; cat "$OUT/gboth.txt"; echo "[$(( $(date +%s) - t0 )) s]"
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not gpus4 and not gpus8" tests/python/test_expert_parallel_gpu.py > "$OUT/ep_gpu.log" 2>&1
echo "pytest expert-parallel exit $?: $(tail -n 1 "$OUT/ep_gpu.log") [$(( $(date +%s) - t0 )) s]"
./build/bin/machmoe-bench --config 7B-256 --warmup-ms 100 --time-ms 100 --json "$OUT/bench_7b.json" 2>/dev/null |
  grep -E "^  (forward|backward) "; echo "bench exit ${PIPESTATUS[0]}"
python3 -c "import json; r=json.load(open('$OUT/bench_7b.json'))[0]; print({k: r.get(k) for k in ('backend','routing','bias','layout','score','tile','cache','dx_chunks','y_chunks','forward_ms','backward_ms')})" 2>&1 | tail -n 2
grep -h "FAILED\|Failure\|error:" "$OUT"/gtest_g*.log 2>/dev/null | head -n 30
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" "$OUT/ep_gpu.log" | head -n 20
for f in "$OUT"/gtest_g*.log "$OUT"/pytest_gpu.log "$OUT"/ep_gpu.log; do xz -f "$f"; done
echo "total [$(( $(date +%s) - t0 )) s]"
