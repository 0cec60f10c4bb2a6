#!/usr/bin/env bash
# Session 82, call E (one H200): T7 on today's code. The 12 main rows in both cache modes back to back (top-K, 300 ms
# windows: default `--cache preact`, then the recompute mode `--cache input_only`), then the four rows nearest T7's
# limit again with the modes A B B A. The ratio tables by t7_table.py, which lay beside this script when the call ran
# and is scripts/t7_table.py since (same tables from the same raw files).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
[ -f build/bin/machmoe-bench ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
run() {  # config cache >> file
  timeout 60 ./build/bin/machmoe-bench --config "$1" --cache "$2" --warmup-ms 300 --time-ms 300 --iters 10 --warmup 3 \
    --stage-runs 3 >> "$3" 2>&1
}
st "all rows"
: > "$OUT/callE_t7_raw.txt"
for row in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048; do
  [ $(( $(date +%s) - S )) -lt 420 ] || { echo "t7: out of time before $row"; break; }
  for cache in preact input_only; do run "$row" "$cache" "$OUT/callE_t7_raw.txt"; done
done
st "in turn"
: > "$OUT/callE_t7_in_turn_raw.txt"
for row in 120B-2048 120B-1024 120B-512 30B-1024; do
  for cache in preact input_only input_only preact; do
    [ $(( $(date +%s) - S )) -lt 560 ] || break 2
    run "$row" "$cache" "$OUT/callE_t7_in_turn_raw.txt"
  done
done
python3 scripts/t7_table.py "$OUT/callE_t7_raw.txt" | tee "$OUT/callE_t7_table.md"
python3 scripts/t7_table.py --pairs "$OUT/callE_t7_in_turn_raw.txt" | tee "$OUT/callE_t7_in_turn_table.md"
xz -f "$OUT/callE_t7_raw.txt" "$OUT/callE_t7_in_turn_raw.txt"
st done
