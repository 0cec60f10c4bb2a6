#!/usr/bin/env bash
# Session 61 call A: the gathered families' tiles in expert groups (MACHMOE_HOPPER_EXPERT_GROUP = G; 1 is main's
# along-N order): build, the scheduler's GPU tests, the up-projection and dH stages and both passes for G = 1, 4, 8,
# 16, 32 on four main rows (two rounds, alternating), ncu's HBM bytes of both kernels on 7B (256,128,8) for G = 1 and
# 16; the board's clocks and power logged every 100 ms throughout (for the stage runs against the timed passes).
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
st build
bash scripts/ab.sh build | tail -n 2
st gtest
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperSchedulerProperties.*:HopperHeuristics*' 2>&1 | grep -v "reference GEMM" | tail -n 4
one() {  # cfg G
  local t0; t0=$(date +%s.%N)
  MACHMOE_HOPPER_EXPERT_GROUP=$2 timeout 90 ./build/bin/machmoe-bench --config $1 --routing topk --iters 5 --warmup 2 \
    --stage-runs 3 --warmup-ms 100 --time-ms 100 > /tmp/o.txt 2>&1
  echo "== $1 G=$2 rc=$? t0=$t0 t1=$(date +%s.%N) | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | up $(grep up_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11) | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/expert_groups_raw.txt"
}
st sweep
for r in 1 2; do for cfg in 1.4B-256 7B-256 30B-256 120B-2048; do
  for g in 1 4 8 16 32; do one $cfg $g; done; done; done 2>&1 | tee "$OUT/expert_groups.txt"
st ncu
for g in 1 16; do for k in 'EpilogueActivation<' 'EpilogueActivationGrad'; do
  MACHMOE_HOPPER_EXPERT_GROUP=$g timeout 120 ncu --clock-control none --kernel-name-base demangled -k "regex:$k" \
    --launch-count 1 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    ./build/bin/machmoe-bench --config 7B-256 --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
    --stage-runs 1 > /tmp/ncu.txt 2>&1
  echo "-- 7B-256 G=$g kernel $k rc=$?"
  grep -E "gpu__time|dram__bytes|lts__t_sector" /tmp/ncu.txt
done; done 2>&1 | tee "$OUT/expert_groups_ncu.txt"
kill $SMI
st done
