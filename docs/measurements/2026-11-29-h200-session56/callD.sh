#!/usr/bin/env bash
# session 56, call D: build (the test harness's DeviceBuffer waits for its fills); GpuEmptyWork and the E = 300 / 512
# token-rounding cases twice; pytest's GPU tests; sanitizers on the E = 300 cases and E = 512 with K = 100
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab_token_rounding.sh build
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_repeat=2 \
  --gtest_filter="GpuEmptyWork.*:*TokenRounding*E300*:*TokenRounding*E512*" > "$OUT/gtest_rerun.log" 2>&1
echo "rerun exit $?"; grep -E "PASSED|FAILED|tests ran" "$OUT/gtest_rerun.log" | sort | uniq -c
bash scripts/ab_token_rounding.sh pyg
SF="*TokenRounding*E300*:*TokenRounding*E512_K100*" bash scripts/ab_token_rounding.sh san
