#!/usr/bin/env bash
# Session 77, call E (one H200): T8 on the six 1.4B and 7B rows after the router backward's change (top-K's backward
# uses it, token rounding's does not): both routings of each row back to back, 300 ms windows, as session 76's call C.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
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
st done
