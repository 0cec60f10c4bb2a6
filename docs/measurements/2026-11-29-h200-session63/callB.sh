#!/usr/bin/env bash
# Session 63 call B: the dH kernel's cooperative tile (staged H, and H through the ring) on the d = 4096 rows that take
# the ping-pong tile (n = 256, 512), forced for the dH kernel alone (MACHMOE_AB_DH_TILE=256; every other GEMM keeps
# its tile): ncu of one launch, then the layer, three variants, two rounds. Then a full ncu report of the ping-pong
# dH kernel on 1.4B (256,128,8) (stall reasons by source line).
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st ncu
nc() {  # label, env..., cfg
  local label=$1; shift; local cfg=${@: -1}; local envs=("${@:1:$#-1}")
  env "${envs[@]}" timeout 60 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:EpilogueActivationGrad" --launch-skip 1 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    ./build/bin/machmoe-bench --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
    --stage-runs 1 > /tmp/ncu.txt 2>&1
  echo "-- $cfg $label rc=$? $(grep -E 'gpu__time|dram__bytes' /tmp/ncu.txt | tr -s ' ' | tr '\n' ' ')"
}
for cfg in 30B-256 30B-512 120B-512; do
  nc pingpong MACHMOE_AB_DH_RING=1 $cfg
  nc coop_staged MACHMOE_AB_DH_RING=0 MACHMOE_AB_DH_TILE=256 $cfg
  nc coop_ring MACHMOE_AB_DH_RING=1 MACHMOE_AB_DH_TILE=256 $cfg
done 2>&1 | tee "$OUT/ncu_dh.txt"
st bench
one() {  # cfg label env...
  local cfg=$1 label=$2; shift 2
  env "$@" timeout 60 ./build/bin/machmoe-bench --config $cfg --routing topk --iters 5 --warmup 2 \
    --stage-runs 5 --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $cfg $label rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for r in 1 2; do for cfg in 30B-256 30B-512 120B-512; do
  one $cfg pingpong MACHMOE_AB_DH_RING=1
  one $cfg coop_staged MACHMOE_AB_DH_RING=0 MACHMOE_AB_DH_TILE=256
  one $cfg coop_ring MACHMOE_AB_DH_RING=1 MACHMOE_AB_DH_TILE=256
done; done 2>&1 | tee "$OUT/bench.txt"
st ncu_full
timeout 150 ncu --clock-control none --kernel-name-base demangled -k "regex:EpilogueActivationGrad" --launch-skip 1 \
  --launch-count 1 --set full --import-source yes -o "$OUT/dh_1p4b_256" \
  ./build/bin/machmoe-bench --config 1.4B-256 --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
  --stage-runs 1 > "$OUT/ncu_full_run.txt" 2>&1; echo "ncu full rc=$?"
ncu --import "$OUT/dh_1p4b_256.ncu-rep" --page details > "$OUT/dh_1p4b_256_details.txt" 2>&1
ncu --import "$OUT/dh_1p4b_256.ncu-rep" --page source --csv --print-source sass > "$OUT/dh_1p4b_256_sass.csv" 2>&1
xz -T4 "$OUT/dh_1p4b_256_sass.csv"; ls -la "$OUT"
kill $SMI
st done
