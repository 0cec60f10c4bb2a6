#!/usr/bin/env bash
# Session 103, call 2 (the casts of master weights now freed before W1's gradient is allocated): build;
# test_autocast.py's GPU tests (the float32 master-weight path); master_weights.py on 7B-256 (1 and 4 layers) and
# 30B-256; then pytest's GPU tests in full (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=docs/measurements/2026-12-06-session103
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call2.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
tail -n 1 "$OUT/build_call2.log"
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python/test_autocast.py \
  > "$OUT/pytest_autocast_call2.log" 2>&1; echo "autocast tests exit $?"; tail -n 1 "$OUT/pytest_autocast_call2.log"
grep -E "^(FAILED|E  )" "$OUT/pytest_autocast_call2.log" | head -20
PYTHONPATH=$PWD/python timeout 150 python3 $here/master_weights.py 2>&1 | tee "$OUT/master_weights_call2.txt"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call2.log"
grep -E "FAILED|Error" "$OUT/pytest_gpu_call2.log" | head -20
rm -f "$OUT"/build*.log
