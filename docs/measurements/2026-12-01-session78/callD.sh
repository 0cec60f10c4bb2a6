#!/usr/bin/env bash
# Session 78, call D (one H200): the whole GPU suite on the session's final GPU code (5c839b0's kernel, a247da4's
# tests): the gtest GPU suite in two shards side by side with pytest's GPU tests; then compute-sanitizer memcheck and
# racecheck on token rounding's kernel tests (the router backward's new path among them).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st "gtest (two shards) and pytest"
bash scripts/ab.sh pyg > "$OUT/callD_pyg.txt" 2>&1 &
pyg=$!
bash scripts/ab.sh gboth 2>&1 | grep -v "^\["
wait $pyg; grep -v "^\[" "$OUT/callD_pyg.txt"
st sanitize
SF='GpuTokenRoundingKernels.*' bash scripts/ab.sh san 2>&1 | grep -v "^\["
for f in gtest_g0 gtest_g1 pytest_gpu sanitize_memcheck sanitize_racecheck; do
  [ -f "$OUT/$f.log" ] && grep -v "reference GEMM" "$OUT/$f.log" | tail -n 40 > "$OUT/callD_${f}_tail.txt" && rm -f "$OUT/$f.log"
done
st done
