#!/usr/bin/env bash
# Session 76, call C (the same H200, warm after call B): pytest's GPU tests (one GPU), then T8: token rounding against
# top-K, both routings of each main row back to back (300 ms windows), as far as the call's time allows; the table by
# scripts/t8_table.py.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st pytest; bash scripts/ab.sh pyg 2>&1 | grep -v "^\["
grep -E "FAILED|Error" "$OUT/pytest_gpu.log" | head -n 20; xz -f "$OUT/pytest_gpu.log"
st t8
: > "$OUT/callC_t8_raw.txt"
for row in ${T8_ROWS:-1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048}; do
  [ $(( $(date +%s) - S )) -lt 540 ] || { echo "t8: out of time before $row"; break; }
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --config "$row" --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/callC_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callC_t8_raw.txt" > "$OUT/callC_t8_table.md" 2>&1; cat "$OUT/callC_t8_table.md"
xz -f "$OUT/callC_t8_raw.txt"
st done
