#!/usr/bin/env bash
# Session 93, call 6 (one H200, fresh): the dH tests after their checks moved into one helper (expect_dh_matches, test
# code only; the library is main's). Build, then every dH kernel test.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st dh tests
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*HopperDh*:HopperEdgeTiles.Dh*' \
  > "$OUT/call6_dh_tests.log" 2>&1
echo "dh tests exit $?"; grep -v "reference GEMM" "$OUT/call6_dh_tests.log" | grep -E "FAILED|PASSED|tests ran" | head -20
rm -f "$OUT"/build*.log
st done
