#!/usr/bin/env bash
# Session 104, call 2 (under the fallback policy "error", every expert GEMM of a layer call is checked before the
# call launches anything; the phases' GEMM arguments built by one function each): build; the new gtest; the whole
# gtest GPU suite (two shards side by side); pytest's GPU tests in full (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call2.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
grep -E "error|warning: unused" "$OUT/build_call2.log" | head -5
timeout 60 ./build/tests/machmoe_gpu_tests --gtest_filter='GpuFallbackPolicy.*' > "$OUT/gtest_new_call2.log" 2>&1
echo "new gtest exit $?"; tail -n 4 "$OUT/gtest_new_call2.log"
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
mv "$OUT/gtest_g0.log" "$OUT/gtest_g0_call2.log"; mv "$OUT/gtest_g1.log" "$OUT/gtest_g1_call2.log"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call2.log"
grep -E "^FAILED|Error" "$OUT/pytest_gpu_call2.log" | head -20
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
