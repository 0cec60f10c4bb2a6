#!/usr/bin/env bash
# Session 107, call 4 (the same H100, warm after call 3, its build kept): T7 with the two cache modes in turn
# (A B B A) on rows near its limit, one bench run each (10 timed iterations at least, 300 ms windows).
# Run as given to the device tool (one line there); written out here.
export OUT=${OUT:-/tmp/out}; S=$(date +%s)
: > $OUT/t7_in_turn_raw_call4.txt
for row in 30B-1024 120B-1024; do
  for cache in preact input_only input_only preact; do
    [ $(( $(date +%s) - S )) -lt 300 ] || break 2
    timeout 60 ./build/bin/machmoe-bench --config "$row" --cache "$cache" --routing topk --warmup-ms 300 --time-ms 300 \
      --iters 10 --warmup 3 --stage-runs 3 >> $OUT/t7_in_turn_raw_call4.txt 2>&1
  done
done
python3 scripts/t7_table.py --pairs $OUT/t7_in_turn_raw_call4.txt | tee $OUT/t7_in_turn_table_call4.md
xz -f $OUT/t7_in_turn_raw_call4.txt
echo "[$(( $(date +%s) - S ))s] done"
