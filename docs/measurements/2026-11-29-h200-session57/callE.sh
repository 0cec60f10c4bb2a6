#!/usr/bin/env bash
# Session 57 call E: the whole GPU suite (gtest in two shards, pytest's GPU tests) on the working tree; memcheck of
# token rounding's E = 512 cases if time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/setup.sh > "$OUT/setup.log" 2>&1
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build.log"
st gboth
bash scripts/ab_token_rounding.sh gboth pyg 2>&1 | tail -n 8
st memcheck
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
  --gtest_brief=1 --gtest_filter='*TokenRounding*E512*' > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | sort -u
st done
