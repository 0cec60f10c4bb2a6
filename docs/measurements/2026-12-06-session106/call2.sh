#!/usr/bin/env bash
# Session 106, call 2 (the machine of call 1, still warm: its build kept): pytest's GPU tests in full (one GPU), then
# the overlap tool with a side stream as long as a small layer's step (4096 MB).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call2.log" 2>&1; stamp "build exit $?"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call2.log"
grep -E "^FAILED|Error" "$OUT/pytest_gpu_call2.log" | head -20
MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=$PWD/python timeout 150 \
  python3 -m machmoe.benchmark.overlap --configs 7B-256,30B-256 --margins 0,8,16,32 --side-mb 4096 --side-chunks 32 \
  --json "$OUT/overlap_4096_call2.json" > "$OUT/overlap_4096_call2.txt" 2>&1
stamp "overlap exit $?"; cat "$OUT/overlap_4096_call2.txt"
rm -f "$OUT"/build*.log
