#!/usr/bin/env bash
# Session 112, call 3: the router GEMM on the project's Hopper store kernel (router_gemm_hopper_probe.diff: one
# "expert" of T rows, x and W_r by TMA, MACHMOE_ROUTER_GEMM_PROBE=hopper) against cuBLAS's, on binaries built on the
# development machine with the diff applied (carried: build/bin, build/lib, build/tests/machmoe_gpu_tests).
#   1. layer gtests with top-K under the probe (their routing then comes from the probe's logits);
#   2. A P P A (A: cuBLAS, P: the probe) on three small rows ($CFGS), 300 ms windows;
#   3. ncu of the probe's GEMM (the forward's first persistent_kernel) on 1.4B-256.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
if ! ./build/bin/machmoe-bench --help > /dev/null 2>&1; then
  lib=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
fi
MACHMOE_ROUTER_GEMM_PROBE=hopper timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*GpuLayer.MatchesFloat64Reference/bf16_swiglu*topk*:GpuStageTiming.*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -20
st "gtests under the probe"
bench() { timeout 30 ./build/bin/machmoe-bench --config "$1" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^  (forward|backward) |router_gemm|topk_scores|routing_metadata"; }
for cfg in ${CFGS:-1.4B-256 7B-256 7B-512}; do
  for side in A P P A; do
    echo "== $cfg $side"
    if [ $side = P ]; then (export MACHMOE_ROUTER_GEMM_PROBE=hopper; bench $cfg); else bench $cfg; fi
  done
done 2>&1 | tee "$OUT/ab.txt"
st "A/B"
MACHMOE_ROUTER_GEMM_PROBE=hopper timeout 60 ncu --clock-control none -k "regex:persistent" --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats ./build/bin/machmoe-bench --config 1.4B-256 \
  --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > "$OUT/ncu_probe.log" 2>&1
grep -E "persistent_kernel|Duration|DRAM Throughput|Compute \(SM\)|Grid Size|Block Size|Waves Per SM|Achieved Occupancy" \
  "$OUT/ncu_probe.log" | cut -c1-130
st total
