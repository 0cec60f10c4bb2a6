#!/usr/bin/env bash
# Session 100, call 1: dX~'s tile by the device's memory bandwidth (the ping-pong tile at K = 1024 only on >= 4000
# GB/s). Builds main's rule (dx_rule.diff reverted) and the new one, then machmoe-bench on the two K = 1024 rows and one
# K = 512 row (unchanged: the control), order base new new base; the heuristics' and device tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=docs/measurements/2026-12-05-session100/dx_rule.diff
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
AB_PATCH=$P bash scripts/ab.sh revert 2>&1 | tail -3     # builds the whole tree with main's rule
KEEP=base bash scripts/ab.sh keep
AB_PATCH=$P bash scripts/ab.sh apply 2>&1 | tail -3      # the new rule (the working tree as committed)
KEEP=new bash scripts/ab.sh keep
for cfg in 30B-512 120B-512 30B-256; do for side in base new new base; do
  echo "== $cfg $side"
  timeout 120 /tmp/bench_$side --config $cfg --warmup-ms 200 --time-ms 200 2>/dev/null |
    grep -E "^gpu:|^config |^  (forward|backward) |backward/(dx_expanded|dh_kernel|dw1|dw2) "
done; done 2>&1 | tee "$OUT/ab.txt"
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuDevice*:*Heuristic*' 2>&1 | tail -4
timeout 60 ./build/tests/machmoe_cpu_tests --gtest_brief=1 --gtest_filter='HopperHeuristics*:*Hardening*' 2>&1 | tail -3
