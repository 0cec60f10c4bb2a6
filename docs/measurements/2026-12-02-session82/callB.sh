#!/usr/bin/env bash
# Session 82, call B (the same H200, warm after call A): T8's two token-rounding sweeps, both routings of each row back
# to back (500 ms windows), then 1.4B (1024,32,2) and (512,64,4) again with the routings in turn (A B B A, 300 ms).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
[ -f build/bin/machmoe-bench ] || bash scripts/ab.sh build 2>&1 | grep -E "exit"
st sweeps
: > "$OUT/callB_t8_sweeps_raw.txt"
for row in 16384:1536:256:64:8 16384:1536:256:128:8 16384:1536:256:256:8 16384:1536:256:512:8 16384:4096:1024:32:4 \
           16384:4096:1024:64:4 16384:4096:1024:128:4 16384:4096:1024:256:4; do
  IFS=: read -r t d n e k <<< "$row"
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --T $t --d $d --n $n --E $e --K $k --warmup-ms 500 --time-ms 500 \
      --routing "$routing" --iters 10 --warmup 3 --stage-runs 3 >> "$OUT/callB_t8_sweeps_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callB_t8_sweeps_raw.txt" > "$OUT/callB_t8_sweeps_table.md" 2>&1
cat "$OUT/callB_t8_sweeps_table.md"; xz -f "$OUT/callB_t8_sweeps_raw.txt"
st "in turn"
for row in 1.4B-1024 1.4B-512; do for r in 1 2; do
  for routing in token_rounding topk topk token_rounding; do
    [ $(( $(date +%s) - S )) -lt 560 ] || break
    timeout 30 ./build/bin/machmoe-bench --config $row --warmup-ms 300 --time-ms 300 --routing $routing --iters 10 \
      --warmup 3 --stage-runs 3 2>/dev/null | grep -E "^  (forward|backward) |forward/(token_rounding|topk_scores|routing_metadata) " \
      | awk -v x=$routing -v c=$row -v r=$r '{print c, "round", r, x, $1, $2}'
  done; done; done | tee "$OUT/callB_in_turn.txt"
st done
