#!/usr/bin/env bash
# Session 59 call E: the experimental L2 prefetch of the gathered rows (MACHMOE_HOPPER_PREFETCH_A = window in k-blocks,
# 0 = off = main's kernels) on the up-projection and the dH kernel, same build, alternating, two rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab_token_rounding.sh build | tail -n 2
one() {  # cfg window
  MACHMOE_HOPPER_PREFETCH_A=$2 timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 10 --warmup 3 --stage-runs 3 \
    --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $1 w=$2 | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep up_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4) | $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4)"
  cat /tmp/o.txt >> "$OUT/prefetch_ab_raw.txt"
}
for r in 1 2; do for cfg in 1.4B-256 7B-256; do for w in 0 4 8; do one $cfg $w; done; done; done 2>&1 | tee "$OUT/prefetch_ab.txt"
st 30B
for w in 0 4 0 4; do one 30B-256 $w; done 2>&1 | tee -a "$OUT/prefetch_ab.txt"
st done
