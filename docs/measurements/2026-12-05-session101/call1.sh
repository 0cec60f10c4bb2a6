#!/usr/bin/env bash
# Session 101, call 1 (an H100): session 100's rule for dX~'s tile (the ping-pong tile at K = 1024 only on >= 4000 GB/s
# memory) measured with the rule built in, on the machine it changes. Builds main's tree with the rule reverted
# ("base": the ping-pong tile at K = 1024 on every Hopper) and as committed ("new": the wide tile on an H100), then
# machmoe-bench on the two K = 1024 rows (order base new new base) and one K = 512 row (unchanged: the control).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=docs/measurements/2026-12-05-session100/dx_rule.diff
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
AB_PATCH=$P bash scripts/ab.sh revert 2>&1 | tail -3     # builds the whole tree with main's old rule
KEEP=base bash scripts/ab.sh keep
AB_PATCH=$P bash scripts/ab.sh apply 2>&1 | tail -3      # the rule (the working tree as committed)
KEEP=new bash scripts/ab.sh keep
for cfg in 30B-512 120B-512; do for side in base new new base; do
  echo "== $cfg $side"
  timeout 120 /tmp/bench_$side --config $cfg --warmup-ms 200 --time-ms 200 2>/dev/null |
    grep -E "^gpu:|^config |^  (forward|backward) |backward/(dx_expanded|dh_kernel|dw1|dw2) "
done; done 2>&1 | tee "$OUT/ab.txt"
for side in base new; do
  echo "== 30B-256 $side"
  timeout 120 /tmp/bench_$side --config 30B-256 --warmup-ms 200 --time-ms 200 2>/dev/null |
    grep -E "^config |^  (forward|backward) |backward/dx_expanded "
done 2>&1 | tee -a "$OUT/ab.txt"
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuDevice*:*Heuristic*' 2>&1 | tail -4
rm -f "$OUT"/build*.log
