#!/usr/bin/env bash
# Session 76, call F (one H200, fresh): the final code (4574520 and docs: stage_ring.cuh, whose 42 Hopper objects have
# the SASS of 8078dab's, compared here with cuobjdump) built, then every gtest GPU test of the Hopper kernels
# (*Hopper*, two shards side by side) as far as the call's time allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
bash scripts/ab.sh build 2>&1 | tail -n 1
echo "build [$(( $(date +%s) - S ))s]"
left=$(( 270 - ($(date +%s) - S) ))
for i in 0 1; do
  ( GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i timeout "$left" ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
      --gtest_filter='*Hopper*' > "$OUT/callF_g$i.log" 2>&1
    echo "g$i exit $?: $(grep -v "reference GEMM" "$OUT/callF_g$i.log" | tail -n 2 | tr '\n' ' ')" ) &
done
wait
grep -h "FAILED\|Failure" "$OUT"/callF_g*.log | head -n 20
echo "done [$(( $(date +%s) - S ))s]"
