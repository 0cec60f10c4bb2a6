#!/bin/bash
# Call 1: build; the new gather-sum tests (and memcheck/racecheck on them); pytest's autocast tests; what
# torch.autocast costs the layer; A/B of the gather-sum's router rows from shared slices against per-pair reads.
set -u
here=docs/measurements/2026-12-05-session98  # (autocast_cost.py)
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( time MACHMOE_JOBS=16 bash scripts/build.sh ) > $OUT/build.log 2>&1; echo "build rc $?"; tail -3 $OUT/build.log
t=./build/tests/machmoe_gpu_tests
timeout 120 $t --gtest_filter='GpuGatherSum*' --gtest_brief=1 > $OUT/gather_sum_tests.log 2>&1
echo "gather tests rc $?"; tail -4 $OUT/gather_sum_tests.log
timeout 150 compute-sanitizer --tool memcheck $t --gtest_filter='GpuGatherSum*BF16' --gtest_brief=1 \
  > $OUT/gather_sum_memcheck.log 2>&1; echo "memcheck rc $?"; tail -3 $OUT/gather_sum_memcheck.log
timeout 150 compute-sanitizer --tool racecheck $t --gtest_filter='GpuGatherSum*E128_topk_BF16:GpuGatherSum*E8*BF16' \
  --gtest_brief=1 > $OUT/gather_sum_racecheck.log 2>&1; echo "racecheck rc $?"; tail -3 $OUT/gather_sum_racecheck.log
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_autocast.py > $OUT/pytest_autocast.log 2>&1
echo "pytest autocast rc $?"; tail -3 $OUT/pytest_autocast.log
PYTHONPATH=$PWD/python timeout 100 python3 $here/autocast_cost.py --configs 7B-256 > $OUT/autocast_cost.txt 2>&1
echo "autocast cost rc $?"; cat $OUT/autocast_cost.txt
for cfg in 7B-256 7B-512 1.4B-256; do
  for s in 1 0 0 1; do
    echo "== $cfg MACHMOE_GATHER_ROUTER_SLICES=$s" >> $OUT/ab.txt
    MACHMOE_GATHER_ROUTER_SLICES=$s timeout 60 ./build/bin/machmoe-bench --config $cfg --warmup-ms 200 --time-ms 200 \
      >> $OUT/ab.txt 2>&1
  done
done
grep -E "^==|^  (forward|backward) |dx_aggregation|dx_expanded" $OUT/ab.txt
