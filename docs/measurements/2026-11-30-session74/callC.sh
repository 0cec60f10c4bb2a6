#!/usr/bin/env bash
# Session 74, call C (one H200): the weight gradients' wide tile with 3 stages and 32 KiB epilogue buffers, its
# TMA-store epilogue in one round (Tile128x256CooperativeWholeStaging, MACHMOE_WGRAD_WHOLE_STAGING=1), against the
# 4-stage tile whose 16 KiB buffers take four rounds (default), one binary. The weight-gradient GPU tests with it on;
# ncu cycles of dW2 and dW1 by scripts/ncu_ab.py on three main rows and the short-segment sweep row; the layer on
# 120B (2048,64,4) alternating (A B B A).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_WHOLE_STAGING=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/callC_gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --rounds 1 \
  --configs 120B-2048,7B-256,30B-1024,sweep=--T:16384:--d:4096:--n:1024:--E:256:--K:4 \
  --side four --side whole:MACHMOE_WGRAD_WHOLE_STAGING=1 --timeout 60 --out "$OUT/callC_ncu.csv"
echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
python3 scripts/ncu_ab.py table "$OUT/callC_ncu.csv" --labels dW2,dW1 | tee "$OUT/callC_ncu_table.md"
for d in 0 1 1 0; do
  left 500 || { echo "== skipped whole $d: time"; continue; }
  echo "== 120B-2048 whole $d"
  MACHMOE_WGRAD_WHOLE_STAGING=$d timeout 40 ./build/bin/machmoe-bench --config 120B-2048 --warmup-ms 200 \
    --time-ms 300 --stage-runs 3 2>/dev/null | grep -E "^  (forward|backward) |backward/dw[12]"
done | tee "$OUT/callC_bench.txt"
xz -f "$OUT/callC_ncu.csv"
echo "total: $(( $(date +%s) - t0 )) s"
