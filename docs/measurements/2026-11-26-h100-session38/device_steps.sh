#!/usr/bin/env bash
# Session 38 device steps: bash .gl/s38.sh step1 step2 ...  (logs to $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for step in "$@"; do
  case "$step" in
    info) nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"; git log --oneline -1 2>/dev/null; git status --short | head ;;
    build) el build; MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$OUT/build.log"; el built ;;
    rbench) nvcc -O2 -arch=sm_90a -o /tmp/rb .gl/router_bench.cu -lcublas && /tmp/rb 2>&1 | tee "$OUT/router_bench.txt" ;;
    g0|g1) idx=${step#g}; el "gtest shard $idx";
      GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$idx timeout ${GT_TIMEOUT:-440} ./build/tests/machmoe_gpu_tests --gtest_brief=1 > "$OUT/gtest_shard$idx.log" 2>&1
      echo "gtest shard $idx rc=$?"; grep -E "tests from .* ran|PASSED|FAILED" "$OUT/gtest_shard$idx.log" | head -20; el done ;;
    gf) timeout 400 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$GF" > "$OUT/gtest_filter.log" 2>&1; echo "gf rc=$?"; grep -E "tests from .* ran|PASSED|FAILED" "$OUT/gtest_filter.log" | head ;;
    pyg) el pytest; MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout ${PY_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider tests/python -m "gpu and not multigpu" > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; tail -n 3 "$OUT/pytest_gpu.log"; el done ;;
    bench) el bench; timeout ${BENCH_TIMEOUT:-300} ./build/bin/machmoe-bench ${BENCH_ARGS:---all-configs} > "$OUT/bench_${BENCH_TAG:-x}.txt" 2>&1; echo "bench rc=$?"; grep -E "^config|forward |backward |router_gemm|router_back|token_rounding|topk_scores|routing_metadata" "$OUT/bench_${BENCH_TAG:-x}.txt" | head -80 ;;
    l2ab) el l2ab; : > "$OUT/l2ab.txt"
      for r in $(seq 1 ${ABR:-2}); do for cfg in ${CFGS:-7B-256}; do for v in ${VARS:-0 1 3 7}; do
        echo "== round $r cfg $cfg hints $v" >> "$OUT/l2ab.txt"
        MACHMOE_HOPPER_L2_HINTS=$v timeout 120 ./build/bin/machmoe-bench --config $cfg --iters 5 --warmup 2 --stage-runs 5 ${ABARGS:-} 2>&1 | grep -E "^  forward |^  backward |up_projection|dh_kernel|down_projection|dx_expanded|aggregation" >> "$OUT/l2ab.txt"
      done; done; done; el l2ab done
      python3 .gl/l2sum.py "$OUT/l2ab.txt" ;;
    xab) el xab; : > "$OUT/xab.txt"
      for r in $(seq 1 ${ABR:-2}); do for cfg in ${CFGS:-7B-256}; do for rt in ${RTS:-topk token_rounding}; do for v in ${XVARS:-base:MACHMOE_XP_GLOBAL_OFFSETS=1 new:MACHMOE_XP_NONE=1}; do
        echo "== round $r cfg $cfg/$rt hints ${v%%:*}" >> "$OUT/xab.txt"
        env ${v#*:} timeout 120 ./build/bin/machmoe-bench --config $cfg --routing $rt --iters 5 --warmup 2 --stage-runs 5 ${ABARGS:-} 2>&1 | grep -E "^  forward |^  backward |forward/|backward/" >> "$OUT/xab.txt"
      done; done; done; done; el xab done
      python3 .gl/xsum.py "$OUT/xab.txt" ;;
    epprof) for c in ${EPCFGS:-7B-256}; do CFG=$c MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout 300 python3 .gl/ep_profile.py > "$OUT/epprof_$c.txt" 2>&1; echo "epprof $c rc=$?"; head -n 40 "$OUT/epprof_$c.txt" | cut -c1-200; done ;;
    epg1) MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout 400 python3 -m pytest -q -p no:cacheprovider tests/python/test_expert_parallel_gpu.py -m "gpu and not multigpu" > "$OUT/ep_gpu1.log" 2>&1; echo "ep gpu1 rc=$?"; tail -n 3 "$OUT/ep_gpu1.log" ;;
    epmulti) MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout 500 python3 -m pytest -q -p no:cacheprovider tests/python/test_expert_parallel_gpu.py -m "multigpu and not gpus4 and not gpus8" > "$OUT/ep_gpu2.log" 2>&1; echo "ep gpu2 rc=$?"; tail -n 5 "$OUT/ep_gpu2.log" ;;
    epbench) cd python && for w in ${EPW:-1}; do NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MACHMOE_TORCH_LIBRARY="$OLDPWD/build/lib/libmachmoe_torch.so" timeout 300 torchrun --standalone --nproc-per-node $w -m machmoe.parallel_benchmark ${EPBARGS:-} $( [ $w -gt 1 ] && echo --baseline "$OUT/ep1.json" ) --json "$OUT/ep$w.json" > "$OUT/epbench$w.txt" 2>&1; echo "epbench $w rc=$?"; tail -n 12 "$OUT/epbench$w.txt"; done; cd .. ;;
    epbench2) for w in ${EPW:-1 2}; do for side in old new; do dir=python; [ $side = old ] && dir=.gl/python_old
        (cd $dir && NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MACHMOE_TORCH_LIBRARY="$OLDPWD/build/lib/libmachmoe_torch.so" timeout 200 torchrun --standalone --nproc-per-node $w -m machmoe.parallel_benchmark ${EPBARGS:-} $( [ $w -gt 1 ] && echo --baseline "$OUT/ep1_$side.json" ) --json "$OUT/ep${w}_$side.json" > "$OUT/epbench${w}_$side.txt" 2>&1); echo "epbench $w $side rc=$?"; grep -E "EP=" "$OUT/epbench${w}_$side.txt"; done; done ;;
    comb) MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_combine_rows.py > "$OUT/combine_pytest.log" 2>&1; echo "combine pytest rc=$?"; tail -n 3 "$OUT/combine_pytest.log" ;;
    san) for tool in memcheck racecheck; do MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" timeout 400 compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -p no:cacheprovider tests/python/test_combine_rows.py -m gpu > "$OUT/san_$tool.log" 2>&1; echo "san $tool rc=$?"; grep -E "ERROR SUMMARY|hazards displayed|passed|failed" "$OUT/san_$tool.log" | tail -n 4; done ;;
    *) echo "unknown step $step" ;;
  esac
done
