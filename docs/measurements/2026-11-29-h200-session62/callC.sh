#!/usr/bin/env bash
# Session 62 call C: call B's A/B again with the whole passes as the measure (300 ms windows, three rounds,
# alternating): dX's router term summed from the pairs in the gather-sum ("sum") against main's dense dlogits W_r
# GEMM with beta = 1 ("gemm", MACHMOE_AB_ROUTER_TERM_GEMM=1), same build.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st bench
one() {  # cfg side
  if [ "$2" = gemm ]; then export MACHMOE_AB_ROUTER_TERM_GEMM=1; else unset MACHMOE_AB_ROUTER_TERM_GEMM; fi
  timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 10 --warmup 3 --stage-runs 3 \
    --warmup-ms 300 --time-ms 300 > /tmp/o.txt 2>&1
  echo "== $1 $2 rc=$? | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep -E 'dx_aggregation|router_backward|router_gemms' /tmp/o.txt | tr -s ' ' | cut -d' ' -f2,3 | tr '\n' ' ')"
  cat /tmp/o.txt >> "$OUT/router_term_raw.txt"
}
for r in 1 2 3; do for cfg in 1.4B-256 7B-256 30B-256 30B-1024 120B-2048; do
  if [ $((r % 2)) = 1 ]; then sides="gemm sum"; else sides="sum gemm"; fi
  for side in $sides; do one $cfg $side; done; done; done 2>&1 | tee "$OUT/router_term_bench.txt"
kill $SMI
st done
