#!/usr/bin/env bash
# Session 63 call A: the dH kernel's cooperative tile with H through the mainloop's ring (Tile128x256CooperativeRingH)
# against the staged-H tile it replaces (MACHMOE_AB_DH_RING=0), one build. Build; the dH GPU tests (ring side);
# ncu of the dH kernel (one launch, --clock-control none) on the rows that take the wide tile, both sides, and with
# the wide tile forced (MACHMOE_HOPPER_TILE_N=256) on four ping-pong rows against their default; the layer on the
# wide-tile rows, both sides, two rounds.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st gtest
timeout 170 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperDh*:HopperEdgeTiles.DhKernel*:GpuLayerProperties.WideDhTile*' 2>&1 |
  grep -v "reference GEMM" | tail -n 4
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
{
for cfg in 120B-2048 30B-1024 120B-1024; do
  nc staged MACHMOE_AB_DH_RING=0 $cfg; nc ring MACHMOE_AB_DH_RING=1 $cfg
done
for cfg in 30B-256 120B-512 7B-256 1.4B-256; do
  nc pingpong MACHMOE_AB_DH_RING=1 $cfg; nc ring_forced MACHMOE_AB_DH_RING=1 MACHMOE_HOPPER_TILE_N=256 $cfg
done
} 2>&1 | tee "$OUT/ncu_dh.txt"
st bench
one() {  # cfg ring
  MACHMOE_AB_DH_RING=$2 timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 5 --warmup 2 \
    --stage-runs 5 --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $1 ring=$2 rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for r in 1 2; do for cfg in 120B-2048 30B-1024; do for ring in 0 1; do one $cfg $ring; done; done; done 2>&1 |
  tee "$OUT/bench.txt"
kill $SMI
st done
