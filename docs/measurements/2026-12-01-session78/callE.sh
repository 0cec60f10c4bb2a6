#!/usr/bin/env bash
# Session 78, call E (one H200): T8 on the six 1.4B and 7B rows after token rounding's router backward got its own
# register path (5c839b0; top-K's backward unchanged): both routings of each row back to back, 300 ms windows, as
# session 77's call E; then 1.4B (256,128,8) with the two routings in turn, A B B A, two rounds, as its call F.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st t8
: > "$OUT/callE_t8_raw.txt"
for row in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024; do
  [ $(( $(date +%s) - S )) -lt 300 ] || { echo "t8: out of time before $row"; break; }
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --config "$row" --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/callE_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callE_t8_raw.txt" > "$OUT/callE_t8_table.md" 2>&1; cat "$OUT/callE_t8_table.md"
xz -f "$OUT/callE_t8_raw.txt"
st "in turn"
for r in 1 2; do for routing in token_rounding topk topk token_rounding; do
  [ $(( $(date +%s) - S )) -lt 420 ] || break 2
  timeout 40 ./build/bin/machmoe-bench --config 1.4B-256 --warmup-ms 300 --time-ms 300 --routing $routing --iters 10 \
    --warmup 3 --stage-runs 1 2>/dev/null | grep -E "^  (forward|backward) " | awk -v r=$r -v x=$routing '{print r, x, $1, $2}'
done; done | tee "$OUT/callE_in_turn.txt"
st done
