#!/usr/bin/env bash
# Session 62 call B: dX's router term summed from the pairs inside the gather-sum (top-K, renormalised score, no
# upstream gradient of the logits) against the dense dlogits W_r GEMM with beta = 1 after it (main's path; forced by
# MACHMOE_AB_ROUTER_TERM_GEMM=1 in the same build). Build, the layer-level GPU tests, the memory CPU test, then the
# layer's backward and its stages for both paths on six rows, alternating, two rounds.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/ab.sh build | tail -n 2
st tests
timeout 60 ./build/tests/machmoe_cpu_tests --gtest_brief=1 --gtest_filter='MemoryAccounting*' 2>&1 | tail -n 2
GTEST_FILTER='GpuLayer*:GpuEdgeShapes*:GpuAccumulate*' timeout 330 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  > "$OUT/gtest_layer.log" 2>&1
echo "layer tests exit $?"; grep -v "reference GEMM" "$OUT/gtest_layer.log" | grep -E "FAILED|PASSED|tests ran|Failure|dx \[|dW_router" | head -20
st bench
one() {  # cfg side
  if [ "$2" = gemm ]; then export MACHMOE_AB_ROUTER_TERM_GEMM=1; else unset MACHMOE_AB_ROUTER_TERM_GEMM; fi
  timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 5 --warmup 2 --stage-runs 5 \
    --warmup-ms 150 --time-ms 150 > /tmp/o.txt 2>&1
  echo "== $1 $2 rc=$? | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep -E 'dx_aggregation|router_backward|router_gemms' /tmp/o.txt | tr -s ' ' | cut -d' ' -f2,3 | tr '\n' ' ')"
  cat /tmp/o.txt >> "$OUT/router_term_raw.txt"
}
for r in 1 2; do for cfg in 1.4B-256 1.4B-1024 7B-256 30B-256 30B-1024 120B-2048; do for side in gemm sum; do
  one $cfg $side; done; done; done 2>&1 | tee "$OUT/router_term_bench.txt"
st done
