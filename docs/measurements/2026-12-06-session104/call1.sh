#!/usr/bin/env bash
# Session 104, call 1 (machmoe.parallel takes float32 master weights under autocast; the operators' accumulation
# buffers of master weights in float32 only): build; the new GPU tests (the one-GPU expert-parallel scenarios, among
# them autocast_master_weights, and test_autocast.py's); the expert-parallel layer's step, memory and gradients
# before and after (ep_master_weights.py); then pytest's GPU tests in full (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=docs/measurements/2026-12-06-session104
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call1.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call1.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
tail -n 3 "$OUT/build_call1.log"
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" \
  test_autocast.py test_expert_parallel_gpu.py > "$OUT/pytest_new_call1.log" 2>&1); echo "new tests exit $?"
tail -n 3 "$OUT/pytest_new_call1.log"; grep -E "^FAILED|Error" "$OUT/pytest_new_call1.log" | head -10
PYTHONPATH=$PWD/python timeout 150 python3 $here/ep_master_weights.py --rounds 2 > "$OUT/ep_master_weights_call1.txt" 2>&1
echo "ep_master_weights exit $?"; cat "$OUT/ep_master_weights_call1.txt" | grep -v Warning | tail -n 20
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call1.log"
grep -E "^FAILED|Error" "$OUT/pytest_gpu_call1.log" | head -20
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
