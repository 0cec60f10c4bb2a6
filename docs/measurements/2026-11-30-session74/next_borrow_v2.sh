#!/usr/bin/env bash
# NOT RUN (written in session 74 after its device time was spent): the A/B that would land borrow_stage_v2.diff.
# On the 2-GPU H200 (GPU 0), from a clean checkout of the commit the diff was made against (f2e86ce's kernels):
# main's binary built first, then the diff applied and built; ncu cycles of dW2 and dW1, three sides (main, the new
# binary with MACHMOE_WGRAD_BORROW=0, the new binary as it would land) on four main rows, the short-segment sweep row
# (groups of m-tiles: the borrowing is off there, so "new" must equal "off") and 7B (256,128,8) with fp32
# accumulation (the register-path variants of the same kernel). If "off" and the accumulation rows stay within
# 0.3 % of main and "new" is faster on the long-segment rows, commit the diff and run the whole GPU suite
# (session 74's callF.sh, with a longer limit for racecheck and the expert-parallel tests).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=0
t0=$(date +%s)
patch=docs/measurements/2026-11-30-session74/borrow_stage_v2.diff
files=$(grep '^+++ b/' "$patch" | cut -c7-)
bash scripts/ab.sh build 2>&1 | tail -n 2
cp build/bin/machmoe-bench /tmp/bench_main
git apply "$patch" && touch $files
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "builds: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_BORROW=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 3
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 \
  --configs 120B-2048,30B-1024,30B-256,7B-256,sweep=--T:16384:--d:4096:--n:1024:--E:256:--K:4 \
  --side main@/tmp/bench_main --side off:MACHMOE_WGRAD_BORROW=0 --side new --timeout 60 --out "$OUT/ncu.csv"
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --configs acc7B=--config:7B-256 \
  --side main@/tmp/bench_main --side new --timeout 60 --out "$OUT/ncu_acc.csv" -- --grad-dtype fp32 --accumulate-grads
python3 scripts/ncu_ab.py table "$OUT/ncu.csv" --labels dW2,dW1
python3 scripts/ncu_ab.py table "$OUT/ncu_acc.csv" --labels dW2,dW1
git apply -R "$patch" && touch $files
echo "total: $(( $(date +%s) - t0 )) s"
