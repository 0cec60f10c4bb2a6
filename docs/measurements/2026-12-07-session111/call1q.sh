#!/usr/bin/env bash
# Session 111's one device call (about 300 s were left after failed starts), on router_topk_fused_measured.diff
# applied to the checkout and built on the development machine (bash scripts/build.sh; build/bin, build/lib and
# build/tests/machmoe_gpu_tests carried, so the call compiles nothing). The routing gtests as a gate; machmoe-bench
# B A A B on two top-K rows and one token-rounding row (A: the same binary with MACHMOE_ROUTER_TOPK_FUSED=0, cuBLAS
# and the top-K kernel as landed); then the whole GPU suite in $SHARDS (default 6) gtest shards side by side beside
# pytest's GPU tests and compute-sanitizer memcheck + racecheck on the new test, each stopped at the call's end (a
# shard stopped by then has no summary line: the suite did not finish).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-290} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
if ! ./build/bin/machmoe-bench --help > /dev/null 2>&1; then
  lib=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  ./build/bin/machmoe-bench --help > /dev/null 2>&1 || { ./build/bin/machmoe-bench --help 2>&1 | head -5; exit 3; }
  echo "binaries start with $lib on the library path"
fi
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:GpuStageTiming.*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -20
st "routing gtests"
bench() { timeout 20 ./build/bin/machmoe-bench --config "$1" --routing "$2" --warmup-ms 200 --time-ms 200 2>&1 |
  grep -E "^  (forward|backward) |router_gemm|router_topk|topk_scores|routing_metadata|forward/token_rounding"; }
for run in 1.4B-256:topk 7B-512:topk 1.4B-256:token_rounding; do
  for side in B A A B; do
    [ "$(left)" -gt 200 ] || break 2
    echo "== ${run%%:*} ${run#*:} $side"
    if [ $side = B ]; then bench ${run%%:*} ${run#*:}; else MACHMOE_ROUTER_TOPK_FUSED=0 bench ${run%%:*} ${run#*:}; fi
  done
done
st "A/B rows"
budget=$(( $(left) - 12 ))
( for tool in memcheck racecheck; do
    MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 \
      ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
      --gtest_filter='GpuRoutingMetadataTopK.RouterGemmAndTopKInOneKernel' > "$OUT/san_$tool.log" 2>&1
    echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/san_$tool.log" | sort -u | tr '\n' ' ')"
  done > "$OUT/san_summary.txt" ) &
n=${SHARDS:-6}; pids=()
for i in $(seq 0 $((n - 1))); do
  MACHMOE_GPU_TEST_TIMEOUT_S=300 GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout $budget \
    ./build/tests/machmoe_gpu_tests --gtest_brief=1 > "$OUT/gtest_s$i.log" 2>&1 & pids+=($!)
done
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONUNBUFFERED=1 timeout $budget \
  python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python > "$OUT/pytest_gpu.log" 2>&1
echo "pytest exit $?: $(tail -n 1 "$OUT/pytest_gpu.log")"
for i in $(seq 0 $((n - 1))); do
  wait "${pids[$i]}"; echo "shard $i exit $?: $(grep -v "reference GEMM" "$OUT/gtest_s$i.log" | grep -E "PASSED|FAILED|tests ran" | tr '\n' ' ')"
done
grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -10
grep -hE "^\[  FAILED|Failure" "$OUT"/gtest_s*.log | head -10
wait; cat "$OUT/san_summary.txt"
st total
(cd "$OUT" && tar -cJf logs_call1q.tar.xz *.log 2>/dev/null && rm -f *.log)
