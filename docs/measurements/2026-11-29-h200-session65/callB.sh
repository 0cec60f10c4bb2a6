#!/usr/bin/env bash
# Session 65, call B: the branch (the GLU dH epilogue's 8-byte shared-memory accesses, plus machmoe-bench --profile
# timing the backward back to back as well) built; the whole gtest GPU suite in two shards; then --profile on three
# rows: the forward and the backward each issued 20 times back to back (the host's launch latency hidden) against one
# timed call, to see whether 1.4B (256,128,8)'s backward pass outlasts its stages by the host's time.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/ab.sh build | tail -n 1
st gtest
bash scripts/ab.sh gboth
st profile
for cfg in 1.4B-256 7B-256 1.4B-1024 30B-256; do
  timeout 90 ./build/bin/machmoe-bench --config $cfg --routing topk --iters 5 --warmup 2 --stage-runs 5 \
    --warmup-ms 300 --time-ms 300 --profile > /tmp/o.txt 2>&1
  echo "== $cfg rc=$? | $(grep -E '^  (forward|backward) ' /tmp/o.txt | tr -s ' ' | tr '\n' '|') $(grep -E 'they add up' /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-)"
  grep -E "back-to-back" /tmp/o.txt
done 2>&1 | tee "$OUT/profile.txt"
st done
