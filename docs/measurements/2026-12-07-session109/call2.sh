#!/usr/bin/env bash
# Session 109, the landing call for W1 as a view of two halves (torchtitan's w1 and w3 read in place): build; the
# whole GPU suite (both gtest shards beside pytest's GPU tests); TorchTitanGroupedExperts in place against
# concatenating against GroupedExperts (torchtitan_in_place.py); one machmoe-bench row for the dH kernel's new
# bytes-at-copy-bandwidth line; then compute-sanitizer memcheck on the new W1 test: each after the suites as far as
# the call's time (CALL_S) allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=docs/measurements/2026-12-07-session109
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build.log" 2>&1; st "build exit $?"
grep -E " error|FAILED" "$OUT/build.log" | head
OUT=$OUT bash scripts/ab.sh pyg > /dev/null 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
wait $pyg; st "suites done"
tail -n 2 "$OUT/pytest_gpu.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
grep -hE "^\[  FAILED|Failure" "$OUT"/gtest_g*.log | head -20
# What follows runs only with enough of the call's time left (CALL_S, default 560 s; a margin for the archive).
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - S) )); }
if [ "$(left)" -gt 80 ]; then
  MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout $(( $(left) - 10 )) \
    python3 $here/torchtitan_in_place.py 2>&1 | grep -v Warning
  st "torchtitan exit $?"
fi
if [ "$(left)" -gt 30 ]; then
  timeout 40 ./build/bin/machmoe-bench --config 1.4B-256 --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
    grep -E "^config|^  (forward|backward) |dh_kernel"
fi
# compute-sanitizer memcheck on the new test with what is left.
left=$(left)
if [ "$left" -gt 30 ]; then
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout "$left" compute-sanitizer --tool memcheck --error-exitcode 9 \
    ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuLayerProperties.W1Halves*' \
    > "$OUT/sanitize_memcheck_w1.log" 2>&1
  st "memcheck exit $? $(grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitize_memcheck_w1.log" | sort -u | tr '\n' ' ')"
fi
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log && rm -f *.log)
