#!/usr/bin/env bash
# Session 94, call 4 (a fresh H200): the whole gtest GPU suite on main as this session leaves it (session 92's kernels,
# the dH test with every count of a warp's rows), in two shards side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git log --oneline -1
OUT=$OUT bash scripts/ab.sh build gboth 2>&1 | tail -12
for s in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$s.log" | tail -n 3 > "$OUT/call4_gtest_shard$s.txt"; done
rm -f "$OUT"/build*.log
