#!/usr/bin/env bash
# Session 100, call 2 (call 1's machine, its build: the working tree with the new dX~ rule): the whole gtest GPU suite
# in two shards side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call2.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build_call2.log"
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -8
for s in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$s.log" | tail -n 3 > "$OUT/call2_gtest_shard$s.txt"; done
grep -h "FAILED" "$OUT"/gtest_g*.log | head -20
rm -f "$OUT"/build*.log "$OUT"/gtest_g*.log
