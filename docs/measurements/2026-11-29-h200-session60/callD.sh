#!/usr/bin/env bash
# Session 60 call D: the whole GPU suite on the final code (the down-projection and dX~ on the ping-pong tile where
# d >= 4096 and K is short; the binding's kernel registration in one helper): gtest in two shards, pytest's GPU set;
# then one benchmark run of the rows the heuristic changed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh build gboth pyg 2>&1 | grep -v "^\[.*\] ==" | tail -n 12
st bench
for cfg in 30B-256 30B-512 120B-512; do
  timeout 40 ./build/bin/machmoe-bench --config $cfg --routing topk --iters 5 --warmup 2 --stage-runs 3 --warmup-ms 200 \
    --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $cfg rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | down $(grep down_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11) | dx $(grep dx_expanded /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_final_raw.txt"
done 2>&1 | tee "$OUT/bench_final.txt"
st done
