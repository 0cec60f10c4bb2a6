#!/usr/bin/env bash
# Session 107, call 1 (session 106's review mends applied: the weight-gradient launch reads the margin once, the layer's check
# queries the SMs only under a margin, more tests): build; the new gtest and pytest's new GPU tests; then the whole
# gtest GPU suite's two shards and pytest's GPU tests in full, all three side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call1.txt"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call1.log" 2>&1; stamp "build exit $?"
grep -E "error|warning: unused" "$OUT/build_call1.log" | head -5
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_filter='GpuSmMargin.*' > "$OUT/gtest_new_call1.log" 2>&1
stamp "new gtest exit $?"; grep -E "^\[ +(OK|FAILED|PASSED) |Failure|expected|Which is" "$OUT/gtest_new_call1.log" | head -20
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 200 python3 -m pytest -v \
  -p no:cacheprovider -m gpu tests/python/test_sm_margin.py "tests/python/test_torch_gpu.py::test_compile_with_a_dynamic_token_count_compiles_once_and_matches_eager_bitwise" > "$OUT/pytest_new_call1.log" 2>&1
stamp "new pytest exit $?"; grep -E "PASS|FAIL|ERROR|Error|assert" "$OUT/pytest_new_call1.log" | tail -n 20
OUT=$OUT bash scripts/ab.sh pyg > "$OUT/pyg_call1.txt" 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
stamp "gtest shards done"
wait $pyg; tail -n 2 "$OUT/pyg_call1.txt"
mv "$OUT/gtest_g0.log" "$OUT/gtest_g0_call1.log"; mv "$OUT/gtest_g1.log" "$OUT/gtest_g1_call1.log"
mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call1.log"; grep -E "^FAILED|Error" "$OUT/pytest_gpu_call1.log" | head -20
stamp "total"
rm -f "$OUT"/build*.log "$OUT/pyg_call1.txt"
