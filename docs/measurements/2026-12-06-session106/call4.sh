#!/usr/bin/env bash
# Session 106, call 4 (call 3's machine, still warm: its build kept): pytest's GPU tests in full (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call4.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call4.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -3; mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call4.log"
grep -E "^FAILED|Error" "$OUT/pytest_gpu_call4.log" | head -20
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
