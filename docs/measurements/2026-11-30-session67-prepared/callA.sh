#!/usr/bin/env bash
# Written in session 67 (no device time left that session) and not run: the GPU check that
# caller_pairs_and_topk_race.diff needs before it may land. One device call on a fresh lease, about 8-9 minutes:
# apply the diff, full build (with the PyTorch operators), the new and the neighbouring caller-routing and top-K tests
# first (their result decides the rest), then the whole gtest GPU binary in two shards (about 7 minutes in all).
# callB.sh follows on the warm machine: pytest's GPU tests and compute-sanitizer memcheck of the new test.
set -uo pipefail
cd "$(dirname "$0")/../../.."
M=docs/measurements/2026-11-30-session67-prepared
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
git apply "$M/caller_pairs_and_topk_race.diff" 2>/dev/null || patch -p1 -s < "$M/caller_pairs_and_topk_race.diff" ||
  { echo "the diff does not apply"; exit 3; }
st build
bash scripts/ab.sh build
st targeted
F='*MalformedCallerPairs*:*OutOfRangeCallerPairs*:*TopKOnTheGpuLogits*:*HopperKernelsAgree*:*IndexCheck*:*Caller*'
./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$F" > "$OUT/targeted.log" 2>&1
echo "targeted exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/targeted.log" | tr '\n' ' ')"
st gboth
bash scripts/ab.sh gboth
for f in gtest_g0.log gtest_g1.log; do grep -v "reference GEMM" "$OUT/$f" | tail -n 40 > "$OUT/${f%.log}_tail.txt"; done
st done
bash scripts/ab.sh pack
