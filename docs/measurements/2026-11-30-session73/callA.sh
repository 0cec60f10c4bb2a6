#!/usr/bin/env bash
# Session 73, call A (one H200): session 72's lean_producer_v2.diff (applied to the tree before the call; on with
# MACHMOE_WGRAD_LEAN_PRODUCER=1 in one binary). The weight-gradient GPU tests with it on; ncu (unlocked clock, a few
# metrics) of dW2 and dW1, two backward passes each, both producers, on three main rows; then the layer with both
# producers alternating, three rounds, on the same rows.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_LEAN_PRODUCER=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
CFGS="120B-2048 7B-256 30B-1024"
for cfg in $CFGS; do for lean in 0 1 1 0; do
  left 300 || { echo "== ncu skipped $cfg $lean: time"; continue; }
  echo "== ncu $cfg lean $lean" >> "$OUT/ncu.csv"
  MACHMOE_WGRAD_LEAN_PRODUCER=$lean timeout 60 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:MainloopVarlenK" --launch-count 4 --csv --page raw \
    --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,smsp__inst_executed.sum \
    ./build/bin/machmoe-bench --config $cfg --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    2>/dev/null | grep -E '^"(ID|[0-9])' >> "$OUT/ncu.csv"
done; done
echo "ncu: $(( $(date +%s) - t0 )) s"
run() {  # run <round> <config> <lean 0|1>
  left 520 || { echo "== skipped $*: time"; return; }
  echo "== round $1 $2 lean $3"
  MACHMOE_WGRAD_LEAN_PRODUCER=$3 timeout 40 ./build/bin/machmoe-bench --config "$2" --warmup-ms 200 --time-ms 300 \
    --stage-runs 3 2>/dev/null | tee -a "$OUT/bench_full.txt" | grep -E "^  (forward|backward) |backward/dw[12]"
}
{
  for r in 1 2 3; do for cfg in $CFGS; do
    if [ $((r % 2)) = 1 ]; then run $r $cfg 0; run $r $cfg 1; else run $r $cfg 1; run $r $cfg 0; fi
  done; done
} 2>&1 | tee "$OUT/bench.txt"
xz -f "$OUT/bench_full.txt" 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
