#!/bin/bash
# Call 4 (main, GPU code of session 92): every main row on this H100 with the default cache, top-K, 300 ms windows:
# forward, backward, efficiency, each stage against cuBLAS, activation memory and peak; tables by bench_tables.py.
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( time MACHMOE_JOBS=16 bash scripts/build.sh ) > $OUT/build.log 2>&1; echo "build rc $?"; tail -3 $OUT/build.log
timeout 230 ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs --cache preact \
  --json $OUT/all_preact.json > $OUT/all_preact.txt 2>&1; echo "bench rc $?"
{ python3 scripts/bench_tables.py passes $OUT/all_preact.json; echo; python3 scripts/bench_tables.py stages $OUT/all_preact.json; } \
  > $OUT/call4_tables.md 2>&1; cat $OUT/call4_tables.md  # (the name this folder keeps it under; session 104)
