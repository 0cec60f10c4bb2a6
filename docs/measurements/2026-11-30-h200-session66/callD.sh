#!/usr/bin/env bash
# Session 66, call D (fresh lease, the landed code): build; compute-sanitizer racecheck of the layer test over caller
# pairs out of range (call C's racecheck of two tests ran past its limit); ncu of the gather-sum launches on two rows,
# K = 8 and K = 2 (dram throughput, warps active, and where the warps wait); a second run of every main row, top-K,
# the default cache, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh build | tail -n 1
st racecheck
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
  --gtest_brief=1 --gtest_filter='GpuLayerProperties.OutOfRangeCallerPairsAreSkipped' > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $? $(grep -E "RACECHECK SUMMARY|PASSED|FAILED" "$OUT/racecheck.log" | sort -u | tr '\n' ' ')"
st ncu
for cfg in 1.4B-256 1.4B-1024; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:gather_sum" --launch-count 4 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio \
    ./build/bin/machmoe-bench --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > /tmp/ncu.txt 2>&1
  echo "-- $cfg rc=$?"
  grep -E "gather_sum_kernel|gpu__time|dram__|registers|grid_size|occupancy|warps_active|stalled" /tmp/ncu.txt | tr -s ' ' | cut -c1-120
done 2>&1 | tee "$OUT/ncu_gather_sum.txt"
st "all configs, preact"
timeout 120 ./build/bin/machmoe-bench --all-configs --routing topk --warmup-ms 300 --time-ms 300 \
  --json "$OUT/all_preact_2.json" > "$OUT/all_preact_2.txt" 2>&1
echo "exit $?"
bash scripts/ab.sh pack
st done
