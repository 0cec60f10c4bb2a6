#!/usr/bin/env bash
# Session 110's prepared device calls for router_topk_fused.diff (the router GEMM and top-K in one kernel for bf16
# rows of at most 128 experts, K = 2, 4, 8). Written and compiled in session 110, never run on a GPU: no device time
# was left.
#   bash prepared_call.sh measure   tree A = the checkout as it is (build/), tree B = a copy with the diff (/tmp/b),
#                                   both built at once; on B the new test, the routing tests and the layer tests that
#                                   read the routing; compute-sanitizer memcheck + racecheck on the new test; then the
#                                   small rows, top-K, 300 ms windows, in the order B A A B (their routing stages and
#                                   passes), as far as the call's time (CALL_S, default 560 s) allows
#   bash prepared_call.sh land      apply the diff to the checkout (patch; the device copy has no .git), build; the
#                                   whole gtest GPU suite's two shards beside pytest's GPU tests; every main row with
#                                   top-K (tables on stdout); T8's four deciding rows with what is left
set -uo pipefail
stage="${1:?usage: bash prepared_call.sh measure|land}"
cd "$(dirname "$0")/../../.."
here=docs/measurements/2026-12-07-session110
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
case "$stage" in
  measure)
    rm -rf /tmp/b && mkdir -p /tmp/b && tar --exclude=./build --exclude=./build-cpu --exclude=./build-gpu -cf - . | tar -xf - -C /tmp/b
    (cd /tmp/b && patch -p1 -N -s < "$here/router_topk_fused.diff") && st "tree B patched"
    MACHMOE_JOBS=8 bash scripts/build.sh > "$OUT/build_a.log" 2>&1 & pa=$!
    MACHMOE_JOBS=8 bash /tmp/b/scripts/build.sh > "$OUT/build_b.log" 2>&1; eb=$?
    wait $pa; st "builds A exit $?, B exit $eb"
    grep -hE " error|FAILED" "$OUT/build_a.log" "$OUT/build_b.log" | head
    timeout 180 /tmp/b/build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:*TopK*:*Router*:GpuStageTiming.*:GpuLayerProperties.TwoRuns*:GpuLayerProperties.Buffers*:AllOptions/GpuLayer.MatchesFloat64Reference/*' 2>&1 |
      grep -E "PASSED|FAILED|tests ran|Failure" | head -30
    st "gtests on B"
    for tool in memcheck racecheck; do
      MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
        /tmp/b/build/tests/machmoe_gpu_tests --gtest_brief=1 \
        --gtest_filter='GpuRoutingMetadataTopK.RouterGemmAndTopKInOneKernel' > "$OUT/san_$tool.log" 2>&1
      st "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/san_$tool.log" | sort -u | tr '\n' ' ')"
    done
    bench() { timeout 30 "$1"/build/bin/machmoe-bench --config "$2" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
      grep -E "^  (forward|backward) |router_gemm|router_topk|topk_scores|routing_metadata"; }
    for cfg in 1.4B-256 7B-256 7B-512 1.4B-1024 30B-512 120B-2048; do
      for side in B A A B; do
        [ "$(left)" -gt 30 ] || break 2
        echo "== $cfg $side"
        if [ $side = B ]; then bench /tmp/b $cfg; else bench . $cfg; fi
      done
    done
    st "small rows";;
  land)
    if patch -p1 -N -s --dry-run < "$here/router_topk_fused.diff" > /dev/null 2>&1; then
      patch -p1 -N -s < "$here/router_topk_fused.diff" && st "applied router_topk_fused.diff"
    fi
    OUT=$OUT bash scripts/ab.sh build suites; st "suites done"
    if [ "$(left)" -gt 130 ]; then
      timeout $(( $(left) - 20 )) ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs \
        --cache preact --json "$OUT/all_topk.json" > "$OUT/all_topk.log" 2>&1
      st "all rows exit $?"
      python3 scripts/bench_tables.py passes "$OUT/all_topk.json"; echo
      python3 scripts/bench_tables.py stages "$OUT/all_topk.json"
    fi
    if [ "$(left)" -gt 110 ]; then  # T8's four rows (the routing stage now counts the router GEMM on both sides)
      T8_MAIN='1.4B-256 7B-512' T8_SWEEPS='16384:4096:1024:256:4 16384:1536:256:512:8' T8_MAIN_MS=300 T8_SWEEP_MS=300 \
        T8_DEADLINE_S=$(( $(left) - 10 )) OUT=/tmp/t8 bash scripts/gpu_check.sh t8 > /tmp/t8_log.txt 2>&1
      st "t8 exit $?"; cat /tmp/t8/t8_table.txt
    fi;;
  *) echo "prepared_call.sh: unknown stage '$stage' (measure or land)" >&2; exit 2;;
esac
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
