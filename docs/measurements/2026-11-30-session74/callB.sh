#!/usr/bin/env bash
# Session 74, call B (one H200, warm from call A): the weight gradients' TMA-store epilogue staging its fragments by
# stmatrix .x4 (MACHMOE_WGRAD_STMATRIX=1: 4 instructions a lane per 64 x 64 block instead of 16 32-bit st.shared)
# against the st.shared staging (default), one binary. The weight-gradient GPU tests with stmatrix on; ncu cycles of
# dW2 and dW1 by scripts/ncu_ab.py on three main rows and the short-segment sweep row.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_STMATRIX=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/callB_gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --rounds 2 \
  --configs 120B-2048,7B-256,30B-1024,sweep=--T:16384:--d:4096:--n:1024:--E:256:--K:4 \
  --side sts --side stsm:MACHMOE_WGRAD_STMATRIX=1 --timeout 60 --out "$OUT/callB_ncu.csv"
echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
python3 scripts/ncu_ab.py table "$OUT/callB_ncu.csv" --labels dW2,dW1 | tee "$OUT/callB_ncu_table.md"
xz -f "$OUT/callB_ncu.csv"
echo "total: $(( $(date +%s) - t0 )) s"
