#!/usr/bin/env bash
# Session 92, call 2 (one H200): the checkout with the warp-private dH epilogue (dh_warp_epilogue.diff applied, its
# comments final) built from scratch, and the whole gtest GPU suite in two shards side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
rm -rf build
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st gboth; bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\]"
tail -n 3 "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" > "$OUT/call2_gtest_summary.txt"
grep -hE "^\[  FAILED" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" | head -20
grep -qE "^\[  FAILED" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" && xz -k "$OUT/gtest_g0.log" "$OUT/gtest_g1.log"; rm -f "$OUT/build.log" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log"
st done
