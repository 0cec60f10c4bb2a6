#!/usr/bin/env bash
# Session 63 call C: the dH kernel's wide (cooperative, staged-H) tile where d >= 4096 and n = 256 or 512 too
# (kDhWideMinN 1024 -> 256), against the ping-pong tile those rows took (MACHMOE_AB_DH_TILE=128, an experiment
# switch removed after this call), the whole layer, three rounds of 300 ms windows, the order alternating.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st bench
one() {  # cfg label env...
  local cfg=$1 label=$2; shift 2
  env "$@" timeout 60 ./build/bin/machmoe-bench --config $cfg --routing topk --iters 5 --warmup 2 \
    --stage-runs 5 --warmup-ms 300 --time-ms 300 > /tmp/o.txt 2>&1
  echo "== $cfg $label rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11) | stages $(grep 'add up' /tmp/o.txt | sed 's/.*add up to//')"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for r in 1 2 3; do for cfg in 30B-256 30B-512 120B-512; do
  if [ $((r % 2)) = 1 ]; then one $cfg wide; one $cfg pingpong MACHMOE_AB_DH_TILE=128
  else one $cfg pingpong MACHMOE_AB_DH_TILE=128; one $cfg wide; fi
done; done 2>&1 | tee "$OUT/bench.txt"
kill $SMI
st done
