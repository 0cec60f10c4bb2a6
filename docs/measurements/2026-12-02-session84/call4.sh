#!/usr/bin/env bash
# Session 84, call 4 (a fresh machine, so it builds): the two rows whose routing stage sat nearest T8's 2x in calls 2
# and 3, (16384,1536,256,512,8) and 1.4B (1024,32,2), in turn (token rounding, top-K, top-K, token rounding) for
# three rounds, 300 ms windows; the table by scripts/t8_table.py (one row per run pair).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
if [ ! -x build/bin/machmoe-bench ]; then
  st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
fi
st in_turn
: > "$OUT/call4_in_turn_raw.txt"
for round in 1 2 3; do
  for args in "--T 16384 --d 1536 --n 256 --E 512 --K 8" "--config 1.4B-1024"; do
    [ $(( $(date +%s) - S )) -lt 330 ] || { echo "out of time before round $round"; break 2; }
    for routing in token_rounding topk topk token_rounding; do
      # shellcheck disable=SC2086
      timeout 60 ./build/bin/machmoe-bench $args --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
        --warmup 3 --stage-runs 3 >> "$OUT/call4_in_turn_raw.txt" 2>&1
    done
  done
done
python3 scripts/t8_table.py "$OUT/call4_in_turn_raw.txt" > "$OUT/call4_in_turn_table.md" 2>&1
cat "$OUT/call4_in_turn_table.md"
xz -f "$OUT/call4_in_turn_raw.txt"
st done
