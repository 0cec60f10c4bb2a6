#!/usr/bin/env bash
# Session 107, call 5 (the same H100, warm after call 4, its build kept): T7 with the two cache modes in turn
# (A B B A) on rows near its limit, one bench run each (10 timed iterations at least, 300 ms windows).
# Run as given to the device tool (one line there); written out here.
export OUT=${OUT:-/tmp/out}; S=$(date +%s)
: > $OUT/t7_in_turn_raw_call5.txt
for row in 120B-2048 30B-512 120B-512; do
  for cache in preact input_only input_only preact; do
    [ $(( $(date +%s) - S )) -lt 240 ] || break 2
    timeout 60 ./build/bin/machmoe-bench --config "$row" --cache "$cache" --routing topk --warmup-ms 300 --time-ms 300 \
      --iters 10 --warmup 3 --stage-runs 3 >> $OUT/t7_in_turn_raw_call5.txt 2>&1
  done
done
python3 scripts/t7_table.py --pairs $OUT/t7_in_turn_raw_call5.txt | tee $OUT/t7_in_turn_table_call5.md
xz -f $OUT/t7_in_turn_raw_call5.txt
echo "[$(( $(date +%s) - S ))s] done"
