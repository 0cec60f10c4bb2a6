#!/usr/bin/env bash
# wip/dh-epilogue-batched-loads, call B (not yet run on a GPU), on call A's warm machine: the layer, base against this
# branch (and the faster variant of call A's ncu, SIDES="base new b2" e.g.), two rounds, 300 ms windows, order
# alternating; the dH stage and the backward.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench_of() { case $1 in base) echo /tmp/base/build/bin/machmoe-bench;; new) echo ./build/bin/machmoe-bench;; *) echo /tmp/bench_$1;; esac; }
one() {  # cfg side
  timeout 60 "$(bench_of $2)" --config $1 --routing topk --iters 5 --warmup 2 --stage-runs 5 --warmup-ms 300 \
    --time-ms 300 > /tmp/o.txt 2>&1
  echo "== $1 $2 rc=$? | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
sides=${SIDES:-base new}
for r in 1 2; do for cfg in ${CFGS:-1.4B-256 7B-256 7B-1024 30B-1024}; do
  order=$sides; [ $r = 2 ] && order=$(echo $sides | tr ' ' '\n' | tac | tr '\n' ' ')
  for side in $order; do one $cfg $side; done
done; done 2>&1 | tee "$OUT/bench.txt"
st done
