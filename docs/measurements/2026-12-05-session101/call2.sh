#!/usr/bin/env bash
# Session 101, call 2 (the same machine and build as call 1): pytest's GPU tests (one GPU).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call2.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build_call2.log"
OUT=$OUT bash scripts/ab.sh pyg 2>&1 | tail -4
grep -E "FAILED|Error" "$OUT/pytest_gpu.log" | head -20
rm -f "$OUT"/build*.log
