#!/usr/bin/env bash
# Session 78, call C (one H200): token rounding's router backward for rows of up to 128 experts as its own straight
# path (tr_backward_token_in_registers: one window, every probability and TC score computed once, the independent
# loads first, the full-softmax variant instantiated apart) against main's kernel (main's token_rounding_kernels.cu,
# carried in third_party/variants/). Build both; session 48's bitwise equivalence harness (forward and backward of
# token rounding, main against this checkout, 594 cases); the GPU tests that reach the kernel; ncu cycles of the
# kernel, sides alternating; the layer on 1.4B (256,128,8) A B B A with top-K beside it (T8).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st variant
VARIANTS="main=third_party/variants/token_rounding_kernels_main.cu" bash scripts/ab.sh variants 2>&1 | grep -v "^\["
cp build/bin/machmoe-bench /tmp/bench_new
st equivalence
BASE_SEL=1 BASE_SRC=$PWD/third_party/variants/base timeout 200 \
  bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh > "$OUT/callC_equivalence.txt" 2>&1
echo "equivalence exit $?"; tail -n 3 "$OUT/callC_equivalence.txt"
st tests
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuTokenRoundingKernels.*:AllOptions/GpuLayer.MatchesFloat64Reference/*token_rounding*:*TwoRunsAreBitwise*:*CudaGraph*:*SplitBackward*:*ManyExperts*:GpuEdgeShapes*:*TokenRounding*' \
  > "$OUT/callC_tests.log" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/callC_tests.log" | tail -n 4
st ncu
python3 scripts/ncu_ab.py run --kernel tr_backward --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-512,1.4B-1024,1.4B-256-topk_softmax=--config:1.4B-256:--score:topk_softmax \
  --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/callC_ncu.csv" \
  -- --routing token_rounding > "$OUT/callC_ncu.log" 2>&1
echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/callC_ncu.csv" | tee "$OUT/callC_ncu_table.md"
st layer
for round in 1 2; do
  for side in main new new main topk; do
    [ $(( $(date +%s) - S )) -lt 560 ] || break 2
    routing=token_rounding; bin=/tmp/bench_$side
    [ $side = topk ] && routing=topk bin=/tmp/bench_new
    echo "== 1.4B-256 $side round $round"
    timeout 40 $bin --config 1.4B-256 --routing $routing --warmup-ms 300 --time-ms 300 --stage-runs 3 2>/dev/null |
      grep -E "^  (forward|backward) |backward/router_backward "
  done
done > "$OUT/callC_layer.txt"
cat "$OUT/callC_layer.txt"
st done
