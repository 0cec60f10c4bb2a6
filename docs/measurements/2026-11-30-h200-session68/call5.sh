#!/usr/bin/env bash
# Session 68, call 5 (fresh lease): main with the caller-pairs fix landed (ec060c3), the compiled-autograd binding
# fix (c25db83) and new GPU tests (a layer with T*d and P*2n past 2^31 elements checked on every row and in its
# weight gradients; the edge shapes in fp16 and fp32 too; fp16's tolerance 4e-3). Build, the new tests first, then
# the whole gtest GPU binary in two shards. call6.sh follows on the warm machine: pytest's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build | grep -E "exit|error" | head -5
st new tests
F='GpuLayerLarge.*:*GpuEdgeShapes*:*/fp16*'
MACHMOE_GPU_TEST_PROGRESS=1 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" > "$OUT/new_tests.log" 2>&1
echo "new tests exit $? $(grep -E '^\[  (PASSED|FAILED) |tests from .* ran' "$OUT/new_tests.log" | tr '\n' ' ')"
grep -E "FAILED|Failure|Expected|Which is|row [0-9]|worst|\[[0-9]e-0[0-9]\]" "$OUT/new_tests.log" | head -40
st gboth; bash scripts/ab.sh gboth
for f in gtest_g0 gtest_g1; do grep -v "reference GEMM" "$OUT/$f.log" | tail -n 40 > "$OUT/${f}_tail.txt"; done
st done; bash scripts/ab.sh pack > /dev/null
