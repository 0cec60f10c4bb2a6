#!/usr/bin/env bash
# Session 79, call C (one H200): top-K with one lane per token (topk_scores_lane_kernel, router_kernels.cu) for bf16
# rows of at most 128 experts with K <= 8, against main's warp per token. Build this checkout, and main's
# router_kernels.cu as a variant (/tmp/bench_main); the tests that reach top-K's selection (the new kernel held bitwise
# to the warp kernel through fp32 rows, the layer against float64), both sanitizers on them; ncu cycles of the top-K
# kernel, main and new in turn (A B B A) on three rows; the forward of the six 1.4B and 7B rows, main and new in turn.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/router_kernels.cu VARIANTS="main=third_party/variants/router_main.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st tests
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuRouterKernels.*:*TopKOnTheGpuLogits*:GpuTokenRounding*' 2>&1 | grep -v "reference GEMM" | tail -n 3
F='AllOptions/GpuLayer.MatchesFloat64Reference/bf16*_topk_*:*TwoRunsAreBitwise*:*ManySelections*'
for i in 0 1; do GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter="$F" > "$OUT/callC_layer_g$i.log" 2>&1 & done; wait
for i in 0 1; do grep -v "reference GEMM" "$OUT/callC_layer_g$i.log" | tail -n 2; done
SF='GpuRouterKernels.*:*TopKOnTheGpuLogits*' bash scripts/ab.sh san 2>&1 | grep -E "exit"
st ncu
timeout 200 python3 scripts/ncu_ab.py run --kernel topk_scores --launches 1 --configs 1.4B-256,7B-256,1.4B-1024 \
  --side main@/tmp/bench_main --side new@/tmp/bench_new --rounds 1 --out "$OUT/callC_ncu.csv" -- --routing topk \
  > /dev/null 2>&1; echo "ncu exit $?"
python3 scripts/ncu_ab.py table "$OUT/callC_ncu.csv" | tee "$OUT/callC_ncu_table.md"
st forward
: > "$OUT/callC_fwd.txt"
for row in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024; do for side in main new new main; do
  [ $(( $(date +%s) - S )) -lt 560 ] || break 2
  echo "== $row $side" >> "$OUT/callC_fwd.txt"
  timeout 40 /tmp/bench_$side --config $row --routing topk --warmup-ms 300 --time-ms 300 --iters 10 --warmup 3 \
    --stage-runs 1 2>/dev/null | grep -E "^  forward |forward/(router_gemm|topk_scores|routing_metadata)" >> "$OUT/callC_fwd.txt"
done; done
awk '/^==/{h=$2" "$3} /^  forward /{print h, "forward", $2, "eff", $5} /topk_scores/{print h, "topk_scores", $2}' "$OUT/callC_fwd.txt"
st done
