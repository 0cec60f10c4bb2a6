#!/usr/bin/env bash
# Session 77, call A (one H200): the router backward writing each token's row in two passes (every element as if
# unselected, then each selection's element by its lane) against main's kernel, which searched the selections for
# every element. Build this checkout; main's router_kernels.cu as a variant (/tmp/bench_main); ncu cycles of the
# router backward kernel, both sides alternating; the layer's backward and its router_backward stage, A B B A; the
# layer tests that reach the router backward (every score variant, K > 32 and > 64, edge shapes, graphs, determinism).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=docs/measurements/2026-12-01-session77
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st variant; VARIANT_FILE=src/gpu/router_kernels.cu VARIANTS="main=$M/router_kernels_main.cu" bash scripts/ab.sh variants 2>&1 | grep -v "^\["
cp build/bin/machmoe-bench /tmp/bench_new
st tests
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*ManySelectionsPerToken*:GpuEdgeShapes*:AllOptions/GpuLayer.MatchesFloat64Reference/*:*TwoRunsAreBitwise*:*CudaGraph*:*SplitBackward*:*ManyExperts*' \
  > "$OUT/callA_tests.log" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/callA_tests.log" | tail -n 4
st ncu
python3 scripts/ncu_ab.py run --kernel router_backward --launches 1 --configs 1.4B-256,7B-256,30B-256,1.4B-1024 \
  --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/callA_ncu.csv" > "$OUT/callA_ncu.log" 2>&1
echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/callA_ncu.csv" | tee "$OUT/callA_ncu_table.md"
st layer
for round in 1 2; do
  for cfg in 1.4B-256 7B-256 30B-256 1.4B-1024; do
    for side in main new new main; do
      [ $(( $(date +%s) - S )) -lt 560 ] || break 3
      echo "== $cfg $side round $round"
      timeout 40 /tmp/bench_$side --config $cfg --warmup-ms 300 --time-ms 300 --stage-runs 3 2>/dev/null |
        grep -E "^  (forward|backward) |backward/router_backward "
    done
  done
done > "$OUT/callA_layer.txt"
cat "$OUT/callA_layer.txt"
st done
