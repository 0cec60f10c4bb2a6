#!/usr/bin/env bash
# Session 75, call D (the 2-GPU H200): T7 on the landed code with both cache modes on the same GPU. Call C had run the
# recompute mode on GPU 0 and the default on GPU 1 at once, which compares two boards. Here each GPU runs the six
# 30B and 120B rows (the ones nearest T7's 1.20), the default and the recompute mode alternating (A B B A), 300 ms
# windows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
touch $(grep '^+++ b/' docs/measurements/2026-11-30-session74/borrow_stage_v2.diff | cut -c7-)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
for g in 0 1; do
  (
    export CUDA_VISIBLE_DEVICES=$g
    for cfg in 120B-2048 120B-1024 30B-1024 30B-512 120B-512 30B-256; do
      for cache in preact input_only input_only preact; do
        [ $(( $(date +%s) - t0 )) -lt 500 ] || { echo "== $cfg $cache skipped: time"; continue; }
        echo "== $cfg $cache"
        timeout 40 ./build/bin/machmoe-bench --config $cfg --cache $cache --warmup-ms 300 --time-ms 300 \
          --stage-runs 3 2>/dev/null | grep -E "^  (forward|backward) "
      done
    done
  ) > "$OUT/callD_t7_gpu$g.txt" 2>&1 &
done
wait
cat "$OUT"/callD_t7_gpu*.txt
echo "total [$(( $(date +%s) - t0 )) s]"
