#!/usr/bin/env bash
# Session 116, call 2: every main row on the code that landed (33e515e, the sorting place kernel for 128 <= E <= 256
# with at least 96 blocks), default cache, top-K, 300 ms windows, so that the docs' main table rests on it; then
# 120B (512,256,16), the one main row kAuto sorts that no run had measured, T N (T = MACHMOE_PLACE_BY_TILE=1).
# Carry build/bin (machmoe-bench of 33e515e, built on the development machine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
B="./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300"
timeout 220 $B --all-configs --cache preact --json "$OUT/all_preact_call2.json" > "$OUT/all_preact_call2.txt" 2>&1
st "all rows exit $?"
python3 scripts/bench_tables.py passes "$OUT/all_preact_call2.json" > "$OUT/tables_call2.md" 2>&1
echo >> "$OUT/tables_call2.md"; python3 scripts/bench_tables.py stages "$OUT/all_preact_call2.json" >> "$OUT/tables_call2.md" 2>&1
head -16 "$OUT/tables_call2.md"
for side in T N; do
  echo "== 120B-512 topk $side"; bench_routing "$([ $side = T ] && echo MACHMOE_PLACE_BY_TILE=1)" 120B-512
done 2>&1 | tee "$OUT/ab_call2.txt"
st total
