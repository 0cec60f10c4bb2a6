#!/usr/bin/env bash
# Session 70: what the backward's dX~ in two chunks of tokens costs in time and saves in memory: machmoe-bench with
# the library's heuristic and with --dx-chunks 1, in turn per row, two rounds, 300 ms windows. Run from the
# repository root after `bash scripts/ab.sh build`. (Its first run, with a pattern that missed the GPU report's
# indented lines, printed nothing: call 4.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=./build/bin/machmoe-bench
ROWS=${ROWS:-"7B-256 7B-512 30B-256 120B-512"}
for r in 1 2; do for cfg in $ROWS; do
  for v in "heuristic=" "dx1=--dx-chunks 1"; do
    name=${v%%=*}; args=${v#*=}
    echo "== round $r $cfg $name"
    $B --config "$cfg" $args --warmup-ms 300 --time-ms 300 --stage-runs 1 2>/dev/null | tee -a "$OUT/chunks_full.txt" |
      grep -E "^  (forward|backward) |backward/dx_|activation memory"
  done
done; done 2>&1 | tee "$OUT/chunks.txt"
