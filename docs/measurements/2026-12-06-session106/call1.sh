#!/usr/bin/env bash
# Session 106, call 1 (the SM margin: the expert GEMMs' persistent grids leave set_sm_margin's SMs to other streams;
# and session 104's split of the backward's fallback checks): build; the new gtest (GpuSmMargin, verbose) and
# pytest's new GPU tests; compute-sanitizer memcheck on the one-cluster grid; machmoe-bench's --sm-margin; the
# overlap tool on 7B-256 and 30B-256; then the whole gtest GPU suite in two shards.
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
  -p no:cacheprovider -m gpu tests/python/test_sm_margin.py > "$OUT/pytest_new_call1.log" 2>&1
stamp "new pytest exit $?"; grep -E "PASS|FAIL|ERROR|Error" "$OUT/pytest_new_call1.log" | tail -n 12
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuSmMargin.AMarginThatLeavesNoClusterIsRefused' \
  > "$OUT/sanitize_memcheck_call1.log" 2>&1
stamp "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitize_memcheck_call1.log" | sort -u | tr '\n' ' ')"
for m in 0 16; do
  timeout 60 ./build/bin/machmoe-bench --config 7B-256 --sm-margin $m --warmup-ms 300 --time-ms 500 --stage-runs 1 \
    > "$OUT/bench_7B-256_margin${m}_call1.txt" 2>&1
  stamp "bench margin $m exit $?"; grep -E "^sm margin|^  (forward|backward) " "$OUT/bench_7B-256_margin${m}_call1.txt"
done
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=$PWD/python timeout 150 \
  python3 -m machmoe.benchmark.overlap --configs 7B-256,30B-256 --margins 0,8,16,32 \
  --json "$OUT/overlap_call1.json" > "$OUT/overlap_call1.txt" 2>&1
stamp "overlap exit $?"; cat "$OUT/overlap_call1.txt"
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
mv "$OUT/gtest_g0.log" "$OUT/gtest_g0_call1.log"; mv "$OUT/gtest_g1.log" "$OUT/gtest_g1_call1.log"
stamp "total"
rm -f "$OUT"/build*.log
