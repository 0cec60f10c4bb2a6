#!/usr/bin/env bash
# Session 109, call 1: session 108's topk_histograms.diff against the landed code in one run on one GPU.
# Tree A is the checkout as it is (built into build/, which stays on a warm machine); tree B is a copy with the
# diff applied (/tmp/b). Both build at once; then the routing gtests on B, and the small rows' forward with top-K
# routing, A and B interleaved over two rounds (300 ms windows); token rounding on 1.4B-256 with B for T8's routing
# ratio; torchtitan_in_place.py on A; the W1 halves test and the GEMM tests around it on A. Never ran (no machine
# came); call2.sh, the landing call, ran instead.
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=docs/measurements/2026-12-07-session108
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
rm -rf /tmp/b && mkdir -p /tmp/b && tar --exclude=./build --exclude=./build-cpu --exclude=./build-gpu -cf - . | tar -xf - -C /tmp/b
(cd /tmp/b && patch -p1 -N -s < "$here/topk_histograms.diff") && st "tree B patched"
MACHMOE_JOBS=8 bash scripts/build.sh > "$OUT/build_a.log" 2>&1 & pa=$!
MACHMOE_JOBS=8 bash /tmp/b/scripts/build.sh > "$OUT/build_b.log" 2>&1; eb=$?
wait $pa; ea=$?; st "builds A exit $ea, B exit $eb"
grep -hE " error|FAILED" "$OUT/build_a.log" "$OUT/build_b.log" | head
timeout 120 /tmp/b/build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:*TopK*:*Router*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran" | head -12
st "routing gtests on B"
# W1 as a 4D view with its halves apart (tree A and B alike): the new test, then the layer's concatenated cases and
# the Hopper GEMM tests whose arguments leave the half stride to its default.
timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*W1Halves*:GpuLayerProperties.OneExpert*:GpuLayerProperties.HopperKernelsAgree*:*concatenated*:Hopper*:ReferenceWeightGrad*:*OddShapes*:-HopperDhKernel*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure|error" | head -30
st "W1 halves gtests on A"
bench() { timeout 40 "$1"/build/bin/machmoe-bench --config "$2" --routing "$3" --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^config|^  (forward|backward) |router_gemm|topk|routing_metadata|token_rounding  |dx_chunk_plan|dh_kernel"; }
for round in 1 2; do
  for cfg in 1.4B-256 7B-256 7B-512; do
    echo "== round $round $cfg A"; bench . $cfg topk
    echo "== round $round $cfg B"; bench /tmp/b $cfg topk
  done
done
st "small rows"
echo "== B 1.4B-256 token_rounding"; bench /tmp/b 1.4B-256 token_rounding
echo "== A 1.4B-256 token_rounding"; bench . 1.4B-256 token_rounding
st "token rounding"
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 120 \
  python3 docs/measurements/2026-12-07-session109/torchtitan_in_place.py
st "torchtitan exit $?"
