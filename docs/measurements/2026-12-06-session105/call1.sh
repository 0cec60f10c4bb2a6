#!/usr/bin/env bash
# Session 105, call 1 (torchtitan's experts pass float32 weights with a half x as master weights, without casting
# x; no GPU code changed): build; test_autocast.py's GPU tests (verbose: the new one by name); pytest's GPU tests in
# full (one GPU). The gtest GPU suite is left out: no C++ or CUDA file changed, and the session's device time, spent
# mostly on starts that found no machine, no longer held it.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call1.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call1.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
grep -E "error|warning: unused" "$OUT/build_call1.log" | head -5
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 120 python3 -m pytest -v \
  -p no:cacheprovider -m gpu tests/python/test_autocast.py > "$OUT/pytest_autocast_call1.log" 2>&1
echo "autocast GPU tests exit $?"; grep -E "PASS|FAIL|ERROR" "$OUT/pytest_autocast_call1.log" | tail -n 12
echo "[$(( $(date +%s) - start ))s] pytest GPU"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call1.log"
grep -E "^FAILED|Error" "$OUT/pytest_gpu_call1.log" | head -20
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
