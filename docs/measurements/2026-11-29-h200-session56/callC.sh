#!/usr/bin/env bash
# session 56, call C: build (the select at 256 threads with 128 candidates a warp); T8's sw512 row, both routings,
# two rounds; the whole gtest GPU suite in two shards
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
bash scripts/ab_token_rounding.sh build
SW512="sw512=--T:16384:--d:1536:--n:256:--E:512:--K:8"
ROUNDS=2 SIDES=new TAB_ARGS="--warmup-ms 300 --time-ms 300" TCFGS="$SW512" bash scripts/ab_token_rounding.sh tab > /dev/null
grep -E "^== |forward/(token_rounding|topk|routing)|^  (forward|backward) " "$OUT/tab.txt"
bash scripts/ab_token_rounding.sh gboth
grep -E "FAILED|Failure" "$OUT"/gtest_g*.log | head -20
