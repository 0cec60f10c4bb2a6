#!/usr/bin/env bash
# Session 75, call A (the 2-GPU H200): session 74's borrow_stage_v2.diff (the weight gradients' epilogue in one round,
# staged partly in the tile's last ring stage, the borrowed memory as a 32-bit shared address) against main's binary.
# Main's tree built first, then the diff applied and built. GPU 0: the weight-gradient GPU tests on the new build,
# ncu cycles of dW2 and dW1 by scripts/ncu_ab.py, three sides (main, the new binary with MACHMOE_WGRAD_BORROW=0, the
# new binary as it would land) on four main rows and the short-segment sweep row (groups of m-tiles: borrowing off
# there), then main / new on 7B (256,128,8) with fp32 gradients accumulated (the register-path variants of the same
# kernel). GPU 1 meanwhile: the layer, main and new alternating (A B B A) on 120B (2048,64,4) and 7B (256,128,8),
# then every main row on the new binary (top-K, default cache, 300 ms windows).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
patch=docs/measurements/2026-11-30-session74/borrow_stage_v2.diff
files=$(grep '^+++ b/' "$patch" | cut -c7-)
touch $files
bash scripts/ab.sh build 2>&1 | tail -n 2
cp build/bin/machmoe-bench /tmp/bench_main
echo "main build: $(( $(date +%s) - t0 )) s"
git apply "$patch" && touch $files
bash scripts/ab.sh build 2>&1 | tail -n 2
cp build/bin/machmoe-bench /tmp/bench_new
echo "new build: $(( $(date +%s) - t0 )) s"
(
  export CUDA_VISIBLE_DEVICES=0
  GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 3
  python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 \
    --configs 120B-2048,30B-1024,30B-256,7B-256,sweep=--T:16384:--d:4096:--n:1024:--E:256:--K:4 \
    --side main@/tmp/bench_main --side off:MACHMOE_WGRAD_BORROW=0@/tmp/bench_new --side new@/tmp/bench_new \
    --timeout 60 --out "$OUT/callA_ncu.csv"
  echo "ncu_ab exit $? ($(( $(date +%s) - t0 )) s)"
  python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --configs acc7B=--config:7B-256 \
    --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/callA_ncu_acc.csv" \
    -- --grad-dtype fp32 --accumulate-grads
  echo "ncu_ab acc exit $? ($(( $(date +%s) - t0 )) s)"
  python3 scripts/ncu_ab.py table "$OUT/callA_ncu.csv" --labels dW2,dW1 > "$OUT/callA_ncu_table.md"
  python3 scripts/ncu_ab.py table "$OUT/callA_ncu_acc.csv" --labels dW2,dW1 > "$OUT/callA_ncu_acc_table.md"
) > "$OUT/callA_gpu0.txt" 2>&1 &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for cfg in 120B-2048 7B-256; do
    for side in main new new main; do
      echo "== $cfg $side"
      timeout 40 /tmp/bench_$side --config $cfg --warmup-ms 300 --time-ms 300 --stage-runs 3 2>/dev/null |
        grep -E "^  (forward|backward) |backward/(dh_kernel|dw[12])"
    done
  done > "$OUT/callA_bench.txt"
  echo "layer A/B done ($(( $(date +%s) - t0 )) s)"
  left 330 && timeout 220 /tmp/bench_new --all-configs --routing topk --cache preact --warmup-ms 300 --time-ms 300 \
    --json "$OUT/callA_all_preact.json" > "$OUT/callA_all_preact.txt" 2>&1
  echo "all rows exit $? ($(( $(date +%s) - t0 )) s)"
) > "$OUT/callA_gpu1.txt" 2>&1 &
g1=$!
wait $g0 $g1
cat "$OUT/callA_gpu0.txt" "$OUT/callA_ncu_table.md" "$OUT/callA_ncu_acc_table.md" "$OUT/callA_gpu1.txt" "$OUT/callA_bench.txt"
grep -E "^  (forward|backward) " "$OUT/callA_all_preact.txt" | head -n 30
xz -f "$OUT"/callA_ncu*.csv "$OUT/callA_all_preact.txt" 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
