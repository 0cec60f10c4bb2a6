#!/usr/bin/env bash
# Session 60 call C: the tile of the two families whose A arrives contiguous by TMA (the down-projection and dX~)
# alone, forced by contiguous_tile_override.diff's MACHMOE_AB_CONTIGUOUS_TILE_N (0: the heuristic's, 128 x 256
# cooperative on every main row; 128: the 128 x 128 ping-pong), same build, alternating, two rounds, every main row
# and the gpt-oss shapes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git apply docs/measurements/2026-11-29-h200-session60/contiguous_tile_override.diff 2>/dev/null && echo "override applied"
bash scripts/ab.sh build | tail -n 2
one() {  # cfg tile
  MACHMOE_AB_CONTIGUOUS_TILE_N=$2 timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 5 --warmup 2 \
    --stage-runs 3 --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $1 t=$2 rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | down $(grep down_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11) | dx $(grep dx_expanded /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/contiguous_tile_raw.txt"
}
st ab
for r in 1 2; do for cfg in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048; do
  for t in 0 128; do one $cfg $t; done; done; done 2>&1 | tee "$OUT/contiguous_tile.txt"
st done
