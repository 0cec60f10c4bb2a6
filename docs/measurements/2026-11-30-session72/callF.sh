#!/usr/bin/env bash
# Session 72, call F (one H200): the weight gradients' lean producer (lean_producer.diff, MainloopVarlenK::produce_lean:
# the same copies and barrier protocol with less work per k-block), switched on by MACHMOE_WGRAD_LEAN_PRODUCER=1 in one
# binary: the weight-gradient GPU tests on it, then the layer on three main rows, two rounds, the two producers
# alternating; ncu of the lean dW1 on 120B (2048,64,4) if time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt "$1" ]; }
bash scripts/ab.sh build 2>&1 | tail -n 2
echo "build: $(( $(date +%s) - t0 )) s"
MACHMOE_WGRAD_LEAN_PRODUCER=1 GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tail -n 4 | tee "$OUT/gf.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
run() {  # run <round> <config> <lean 0|1>
  left 215 || { echo "== skipped $*: time"; return; }
  echo "== round $1 $2 lean $3"
  MACHMOE_WGRAD_LEAN_PRODUCER=$3 timeout 40 ./build/bin/machmoe-bench --config "$2" --warmup-ms 200 --time-ms 200 \
    --stage-runs 1 2>/dev/null | tee -a "$OUT/bench_full.txt" | grep -E "^  (forward|backward) |backward/dw[12]"
}
{
  for cfg in 120B-2048 7B-256 30B-1024; do run 1 $cfg 0; run 1 $cfg 1; done
  for cfg in 120B-2048 7B-256 30B-1024; do run 2 $cfg 1; run 2 $cfg 0; done
} 2>&1 | tee "$OUT/bench.txt"
if left 225; then
  MACHMOE_WGRAD_LEAN_PRODUCER=1 timeout 45 ncu --clock-control none --set full --import-source no \
    --kernel-name-base demangled -k "regex:MainloopVarlenK" --launch-skip 1 --launch-count 1 -o "$OUT/dw1_lean" \
    ./build/bin/machmoe-bench --config 120B-2048 --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > "$OUT/ncu_dw1_lean.log" 2>&1
  echo "ncu exit $?"
  ncu --import "$OUT/dw1_lean.ncu-rep" --page source --csv --print-source sass > "$OUT/dw1_lean_sass.csv" 2>&1
  ncu --import "$OUT/dw1_lean.ncu-rep" --page details > "$OUT/dw1_lean_details.txt" 2>&1
  rm -f "$OUT/dw1_lean.ncu-rep"
fi
xz -f "$OUT/bench_full.txt" "$OUT"/*.csv "$OUT"/*_details.txt "$OUT"/*.log 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
