#!/usr/bin/env bash
# Session 79, call D (one H200): the final GPU code (top-K with two lanes a token, topk_scores_lane_kernel). Build,
# and main's router_kernels.cu as a variant (/tmp/bench_main); the whole gtest GPU suite in two shards beside
# pytest's GPU tests; memcheck on the top-K tests, racecheck on each of them alone with its first hazards printed (call
# C's racecheck of the two together reported 2 hazards); ncu cycles of the top-K kernel, main and new in turn (A B B A)
# on three rows; the forward's topk_scores stage of three rows, main and new in turn.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/router_kernels.cu VARIANTS="main=third_party/variants/router_main.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st "top-K tests"
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRouterKernels.*:*TopKOnTheGpuLogits*' 2>&1 |
  grep -v "reference GEMM" | tail -n 2
st "whole suite"
bash scripts/ab.sh pyg > "$OUT/callD_pyg.txt" 2>&1 &
bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\] =="
wait; cat "$OUT/callD_pyg.txt" | grep -vE "^\[[0-9]+s\] =="
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 3 > "$OUT/callD_gtest_g${i}_tail.txt"; done
tail -n 3 "$OUT/pytest_gpu.log" > "$OUT/callD_pytest_gpu_tail.txt"
st sanitizers
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
  --gtest_brief=1 --gtest_filter='GpuRouterKernels.*:*TopKOnTheGpuLogits*' > "$OUT/callD_memcheck.txt" 2>&1
echo "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/callD_memcheck.txt" | sort -u | tr '\n' ' ')"
for f in 'GpuRouterKernels.*' '*TopKOnTheGpuLogits*'; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter="$f" > "$OUT/callD_racecheck.txt" 2>&1
  echo "racecheck $f exit $? $(grep -E "RACECHECK SUMMARY|PASSED|FAILED" "$OUT/callD_racecheck.txt" | sort -u | tr '\n' ' ')"
  grep -m 2 -A 8 -E "Error: Race|Hazard" "$OUT/callD_racecheck.txt" | cut -c1-200 | head -n 24
done
st ncu
[ $(( $(date +%s) - S )) -lt 480 ] && timeout 90 python3 scripts/ncu_ab.py run --kernel topk_scores --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-1024 --side main@/tmp/bench_main --side new@/tmp/bench_new --rounds 1 \
  --out "$OUT/callD_ncu.csv" -- --routing topk > /dev/null 2>&1; echo "ncu exit $?"
[ -f "$OUT/callD_ncu.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callD_ncu.csv" | tee "$OUT/callD_ncu_table.md"
st forward
: > "$OUT/callD_fwd.txt"
for row in 1.4B-256 7B-256 1.4B-512; do for side in main new new main; do
  [ $(( $(date +%s) - S )) -lt 570 ] || break 2
  echo "== $row $side" >> "$OUT/callD_fwd.txt"
  timeout 20 /tmp/bench_$side --config $row --routing topk --warmup-ms 200 --time-ms 200 --iters 10 --warmup 3 \
    --stage-runs 1 2>/dev/null | grep -E "^  forward |forward/topk_scores" >> "$OUT/callD_fwd.txt"
done; done
awk '/^==/{h=$2" "$3} /^  forward /{print h, "forward", $2, "eff", $5} /topk_scores/{print h, "topk_scores", $2}' "$OUT/callD_fwd.txt"
rm -f "$OUT"/gtest_g*.log "$OUT"/sanitize_*.log
st done
