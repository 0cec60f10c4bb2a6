#!/usr/bin/env bash
# Session 74, call A (one H200): the weight gradients' bf16 overwrite stored straight from the accumulator fragments
# (MACHMOE_WGRAD_DIRECT_STORE=1) against the TMA-store epilogue (default), one binary. The weight-gradient GPU tests
# with the direct path on; ncu (unlocked clock) of dW2 and dW1 by scripts/ncu_ab.py (its first GPU run) on three main
# rows and the short-segment sweep row; then the layer with both paths alternating (A B B A) on two rows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_DIRECT_STORE=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/callA_gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --configs 120B-2048,7B-256,30B-1024 \
  --side tma --side direct:MACHMOE_WGRAD_DIRECT_STORE=1 --timeout 60 --out "$OUT/callA_ncu.csv"
echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
left 330 && python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --configs 30B-256 \
  --side tma --side direct:MACHMOE_WGRAD_DIRECT_STORE=1 --timeout 60 --out "$OUT/callA_ncu_sweep.csv" \
  -- --T 16384 --d 4096 --n 1024 --E 256 --K 4
echo "ncu_ab sweep exit $? ($(( $(date +%s) - t0 )) s)"
python3 scripts/ncu_ab.py table "$OUT/callA_ncu.csv" --labels dW2,dW1 | tee "$OUT/callA_ncu_table.md"
[ -f "$OUT/callA_ncu_sweep.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callA_ncu_sweep.csv" --labels dW2,dW1 | tee "$OUT/callA_ncu_sweep_table.md"
for cfg in 120B-2048 7B-256; do for d in 0 1 1 0; do
  left 540 || { echo "== skipped $cfg direct $d: time"; continue; }
  echo "== $cfg direct $d"
  MACHMOE_WGRAD_DIRECT_STORE=$d timeout 40 ./build/bin/machmoe-bench --config $cfg --warmup-ms 200 --time-ms 300 \
    --stage-runs 3 2>/dev/null | tee -a "$OUT/callA_bench_full.txt" | grep -E "^  (forward|backward) |backward/dw[12]"
done; done | tee "$OUT/callA_bench.txt"
xz -f "$OUT/callA_ncu.csv" "$OUT/callA_bench_full.txt" 2>/dev/null; [ -f "$OUT/callA_ncu_sweep.csv" ] && xz -f "$OUT/callA_ncu_sweep.csv"
echo "total: $(( $(date +%s) - t0 )) s"
