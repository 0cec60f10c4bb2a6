#!/usr/bin/env bash
# Session 83, call 2: the landed version (8 tokens a warp in the emit where E <= 32 only; the select's short radix
# select with two barriers a pass and a three-pass step-1 bound) built, and the whole GPU suite on it: gtest in two
# shards side by side, then pytest's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st gboth; bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\]"
st pyg; bash scripts/ab.sh pyg 2>&1 | grep -vE "^\[[0-9]+s\]"
tail -n 3 "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" > "$OUT/call2_suite_summary.txt"; tail -n 1 "$OUT/pytest_gpu.log" >> "$OUT/call2_suite_summary.txt"
grep -E "FAILED|Failure" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" "$OUT/pytest_gpu.log" | head -20
rm -f "$OUT/build.log"
st done
