#!/usr/bin/env bash
# Session 59 call D: the up-projection's tile on the small rows, same machine: the default (128 x 256 cooperative) against
# MACHMOE_HOPPER_TILE_N=128 (128 x 128 ping-pong), alternating, two rounds; forward stages only matter here.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab_token_rounding.sh build
for r in 1 2; do for cfg in 1.4B-256 7B-256 1.4B-512 7B-512; do for t in 0 128; do
  MACHMOE_HOPPER_TILE_N=$t ./build/bin/machmoe-bench --config $cfg --routing topk --iters 10 --warmup 3 --stage-runs 3 \
    --warmup-ms 300 --time-ms 300 > /tmp/o.txt 2>&1
  echo "== r$r $cfg tile_n=$t $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep up_projection /tmp/o.txt | tr -s ' ')"
  cat /tmp/o.txt >> "$OUT/tile_ab_raw.txt"
done; done; done 2>&1 | tee "$OUT/tile_ab.txt"
st done
