#!/usr/bin/env bash
# Session 103, call 3 (layer_backward_weight no longer casts master weights: it reads none): build;
# test_autocast.py's GPU tests (among them defer_weight_grads under autocast, which runs layer_backward_weight on
# master weights); then pytest's GPU tests in full (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call3.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call3.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python/test_autocast.py \
  > "$OUT/pytest_autocast_call3.log" 2>&1; echo "autocast tests exit $?"; tail -n 1 "$OUT/pytest_autocast_call3.log"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call3.log"
grep -E "FAILED|Error" "$OUT/pytest_gpu_call3.log" | head -20
rm -f "$OUT"/build*.log
