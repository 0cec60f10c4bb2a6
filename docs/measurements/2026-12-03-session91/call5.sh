#!/usr/bin/env bash
# Session 91, call 5 (one H200, fresh): main as it lands (the GPU code of session 87; this session changed a comment in
# heuristics.hpp) built, and the whole gtest GPU suite in two shards side by side. Call 6 runs pytest's GPU tests on
# the same machine (session 84's build + both in one call ran past the 600 s limit).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git log -1 --format='%h' 2>/dev/null
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st gboth; bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\]"
tail -n 3 "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" > "$OUT/call5_gtest_summary.txt"
grep -hE "^\[  FAILED" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" | head -20
rm -f "$OUT/build.log" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log"
st done
