#!/usr/bin/env bash
# Session 110, call 1: what session 109 left unrun, and session 108's topk_histograms.diff against the landed code.
# Tree A is the checkout (build/); tree B a copy with the diff applied (/tmp/b). Both build at once (8 jobs each).
# In order, each only with enough of the call's time left (CALL_S, default 560 s):
#   1. pytest: the rewritten torchtitan adapter GPU test, on A
#   2. gtest: the routing tests on B (the new TopKKernelWritesTheTileHistograms among them)
#   3. machmoe-bench, top-K, 300 ms windows, the small rows A and B interleaved over two rounds
#   4. torchtitan_in_place.py on A (TT in place vs concatenating vs GroupedExperts)
#   5. compute-sanitizer memcheck + racecheck: W1 halves test on A, the new routing test on B
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
rm -rf /tmp/b && mkdir -p /tmp/b && tar --exclude=./build --exclude=./build-cpu --exclude=./build-gpu -cf - . | tar -xf - -C /tmp/b
(cd /tmp/b && patch -p1 -N -s < docs/measurements/2026-12-07-session108/topk_histograms.diff) && st "tree B patched"
MACHMOE_JOBS=8 bash scripts/build.sh > "$OUT/build_a.log" 2>&1 & pa=$!
MACHMOE_JOBS=8 bash /tmp/b/scripts/build.sh > "$OUT/build_b.log" 2>&1; eb=$?
wait $pa; ea=$?; st "builds A exit $ea, B exit $eb"
grep -hE " error|FAILED" "$OUT/build_a.log" "$OUT/build_b.log" | head
export MACHMOE_IN_TREE=1
(cd tests/python && MACHMOE_TORCH_LIBRARY=$OLDPWD/build/lib/libmachmoe_torch.so timeout 150 python3 -m pytest -q \
  -p no:cacheprovider -m gpu -k torchtitan_adapter test_torch_gpu.py 2>&1 | tail -n 15)
st "pytest torchtitan adapter"
timeout 120 /tmp/b/build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:*TopK*:*Router*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -12
st "routing gtests on B"
bench() { timeout 40 "$1"/build/bin/machmoe-bench --config "$2" --routing "$3" --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^config|^  (forward|backward) |router_gemm|topk|routing_metadata|token_rounding  |dh_kernel"; }
for round in 1 2; do
  [ "$(left)" -gt 200 ] || break
  for cfg in 1.4B-256 7B-256 7B-512; do
    echo "== round $round $cfg A"; bench . $cfg topk
    echo "== round $round $cfg B"; bench /tmp/b $cfg topk
  done
done
st "small rows"
if [ "$(left)" -gt 120 ]; then
  MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 110 \
    python3 docs/measurements/2026-12-07-session109/torchtitan_in_place.py 2>&1 | grep -v Warning
  st "torchtitan exit $?"
fi
san() {  # tool, binary, filter, log
  [ "$(left)" -gt 30 ] || return
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout $(( $(left) - 10 )) compute-sanitizer --tool "$1" --error-exitcode 9 \
    "$2" --gtest_brief=1 --gtest_filter="$3" > "$OUT/$4" 2>&1
  st "$4 exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$4" | sort -u | tr '\n' ' ')"
}
san memcheck ./build/tests/machmoe_gpu_tests 'GpuLayerProperties.W1Halves*' san_memcheck_w1.log
san memcheck /tmp/b/build/tests/machmoe_gpu_tests 'GpuRoutingMetadataTopK.TopKKernelWritesTheTileHistograms' san_memcheck_hist.log
san racecheck /tmp/b/build/tests/machmoe_gpu_tests 'GpuRoutingMetadataTopK.TopKKernelWritesTheTileHistograms' san_racecheck_hist.log
san racecheck ./build/tests/machmoe_gpu_tests 'GpuLayerProperties.W1Halves*' san_racecheck_w1.log
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log && rm -f *.log)
