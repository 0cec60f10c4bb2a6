#!/usr/bin/env bash
# Session 74, call E (the 2-GPU H200, GPU 0; the machine kept warm for call F): the borrowed-stage epilogue as it
# lands (on by default; MACHMOE_WGRAD_BORROW=0 turns it off) against main's binary (f2e86ce, the tree's source
# changes reversed and built first): ncu cycles of dW2 and dW1 by scripts/ncu_ab.py, three sides (main, the new
# binary with the borrowing off, the new binary as it lands), on four main rows; the layer on 120B (2048,64,4), main
# and new alternating (A B B A).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=0
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
# The tree's source changes, written as a diff before the call (the device's copy may have no .git).
patch=docs/measurements/2026-11-30-session74/borrow_stage.diff
files=$(grep '^+++ b/' "$patch" | cut -c7-)
git apply -R "$patch" && touch $files
bash scripts/ab.sh build 2>&1 | tail -n 2
cp build/bin/machmoe-bench /tmp/bench_main
echo "main build: $(( $(date +%s) - t0 )) s"
git apply "$patch" && touch $files
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "new build: $(( $(date +%s) - t0 )) s"
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --rounds 1 \
  --configs 120B-2048,7B-256,30B-1024,30B-256 \
  --side main@/tmp/bench_main --side off:MACHMOE_WGRAD_BORROW=0 --side new --timeout 60 --out "$OUT/callE_ncu.csv"
echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
python3 scripts/ncu_ab.py table "$OUT/callE_ncu.csv" --labels dW2,dW1 | tee "$OUT/callE_ncu_table.md"
for side in main new new main; do
  left 330 || { echo "== skipped $side: time"; continue; }
  bin=./build/bin/machmoe-bench; [ $side = main ] && bin=/tmp/bench_main
  echo "== 120B-2048 $side"
  timeout 40 $bin --config 120B-2048 --warmup-ms 200 --time-ms 300 --stage-runs 3 2>/dev/null |
    grep -E "^  (forward|backward) |backward/dw[12]"
done | tee "$OUT/callE_bench.txt"
xz -f "$OUT/callE_ncu.csv"
echo "total: $(( $(date +%s) - t0 )) s"
