#!/usr/bin/env bash
# Written in session 67, not run: after callA.sh on the warm machine (build/ kept): pytest's GPU tests, then
# compute-sanitizer memcheck of the new caller-pairs test (racecheck of whole-layer tests runs past a call's limit;
# the new kernels' shared memory is cub's block scan and one carry word behind barriers).
set -uo pipefail
cd "$(dirname "$0")/../../.."
# (the build from callA.sh holds the diff; this copy of the tree does not need it)
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh pyg
tail -n 30 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 250 compute-sanitizer --tool memcheck --error-exitcode 9 \
  ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*MalformedCallerPairs*' > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | sort -u | tr '\n' ' ')"
bash scripts/ab.sh pack
