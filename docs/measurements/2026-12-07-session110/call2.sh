#!/usr/bin/env bash
# Session 110, call 2: the landing call for the top-K kernel writing the tile histograms (67d2389) and the reference
# GEMMs' half_stride() (3ec4590). Build; the whole GPU suite (both gtest shards beside pytest's GPU tests); every
# main row with top-K routing (T1, T2; tables on stdout); compute-sanitizer memcheck + racecheck on the routing
# tests with what is left of the call (CALL_S, default 570 s).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build.log" 2>&1; st "build exit $?"
grep -E " error|FAILED" "$OUT/build.log" | head
OUT=$OUT bash scripts/ab.sh pyg > /dev/null 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
wait $pyg; st "suites done"
tail -n 2 "$OUT/pytest_gpu.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
grep -hE "^\[  FAILED|Failure" "$OUT"/gtest_g*.log | head -20
if [ "$(left)" -gt 130 ]; then
  timeout $(( $(left) - 20 )) ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs \
    --cache preact --json "$OUT/all_topk.json" > "$OUT/all_topk.log" 2>&1
  st "all rows exit $?"
  python3 scripts/bench_tables.py passes "$OUT/all_topk.json"; echo
  python3 scripts/bench_tables.py stages "$OUT/all_topk.json"
  cp "$OUT/all_topk.json" "$OUT/all_topk.json.log"
fi
for tool in memcheck racecheck; do
  [ "$(left)" -gt 30 ] || break
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout $(( $(left) - 10 )) compute-sanitizer --tool $tool --error-exitcode 9 \
    ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadataTopK.*:GpuRoutingMetadata/*' \
    > "$OUT/san_$tool.log" 2>&1
  st "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/san_$tool.log" | sort -u | tr '\n' ' ')"
done
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log && rm -f *.log)
