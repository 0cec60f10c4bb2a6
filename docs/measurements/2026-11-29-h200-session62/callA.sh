#!/usr/bin/env bash
# Session 62 call A: the dH kernel's H prefetched into L2 by TMA just before the epilogue (MACHMOE_AB_DH_H_PREFETCH =
# the k-blocks of the tile's mainloop left when the prefetch is issued: 1, 2 or 4 here; 0 = main's kernel). Session
# 61 tried 16 and 32 (evicted before use). Build, the dH GPU tests with lead 1, ncu of the dH kernel (one launch,
# --clock-control none) for leads 0/1/2/4 on three rows, the layer for leads 0/1/2 on four rows, two rounds.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st gtest
MACHMOE_AB_DH_H_PREFETCH=1 timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperDh*:HopperEdgeTiles.DhKernel*:GpuLayerProperties.WideDhTile*:GpuLayerProperties.TwoRuns*' 2>&1 |
  grep -v "reference GEMM" | tail -n 3
st ncu
for cfg in 1.4B-256 7B-256 120B-2048; do for lead in 0 1 2 4; do
  MACHMOE_AB_DH_H_PREFETCH=$lead timeout 60 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:EpilogueActivationGrad" --launch-skip 1 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    ./build/bin/machmoe-bench --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
    --stage-runs 1 > /tmp/ncu.txt 2>&1
  echo "-- $cfg lead=$lead rc=$? $(grep -E 'gpu__time|dram__bytes|lts__t_sector' /tmp/ncu.txt | tr -s ' ' | tr '\n' ' ')"
done; done 2>&1 | tee "$OUT/h_prefetch_ncu.txt"
st bench
one() {  # cfg lead
  MACHMOE_AB_DH_H_PREFETCH=$2 timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk --iters 5 --warmup 2 \
    --stage-runs 5 --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $1 lead=$2 rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/h_prefetch_raw.txt"
}
for r in 1 2; do for cfg in 1.4B-256 7B-256 30B-256 120B-2048; do for lead in 0 1 2; do one $cfg $lead; done; done; done 2>&1 |
  tee "$OUT/h_prefetch_bench.txt"
kill $SMI
st done
