#!/usr/bin/env bash
# Prepared in session 113, never run (the session's device time ran out on tries that found no machine): the place
# kernel sorting blocks of 2048 pairs by grouped row (place_sorted_kernel, E <= 256; place_sorted.diff) against the
# per-tile place kernel (MACHMOE_PLACE_BY_TILE=1). Before the call, on the development machine: `git apply
# docs/measurements/2026-12-07-session113/place_sorted.diff`, `bash scripts/build.sh`, and carry build/bin, build/lib
# and build/tests/machmoe_gpu_tests.
#   1. the routing gtests as a gate (each runs both place kernels and asserts which one ran);
#   2. ncu of both place kernels and the other routing kernels on $NCU_CFGS (default 1.4B (256,128,8), 7B (256,128,8));
#   3. machmoe-bench, top-K, 300 ms windows, T N N T (T = by tile, N = sorted) on $AB_CFGS (default the 1.4B and 7B
#      (256,128,8) rows and 30B (256,256,16), E = 256), until AB_UNTIL seconds of the call are left (default 380);
#   4. if N's routing_metadata stage is below T's on 1.4B (256,128,8) and 250 s of the call are left (CALL_S, default
#      560): the whole GPU suite (scripts/ab.sh suites) with compute-sanitizer memcheck and racecheck on the routing
#      tests beside it. If the suite does not fit, run `bash scripts/ab.sh suites` in a call of its own.
# Land only if N is faster on the rows it takes and the whole suite passes; then fold the README's figures into
# docs/BENCHMARKS.md and remove MACHMOE_PLACE_BY_TILE (keep place_by_tile for the tests).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*GpuRoutingMetadata*:GpuStageTiming.*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -20
st "routing gtests"
side_env() { case $1 in T) echo MACHMOE_PLACE_BY_TILE=1;; N) echo MACHMOE_PLACE_BY_TILE=0;; esac; }
args="--routing topk --iters 1 --warmup 2 --warmup-ms 0 --time-ms 0 --stage-runs 1"
for cfg in ${NCU_CFGS:-1.4B-256 7B-256}; do
  for side in T N; do
    (export $(side_env $side)
     timeout 60 ncu --clock-control none --kernel-name-base mangled \
       -k "regex:place|scan_tiles|chunk_plan_from|topk_scores|lanes" --launch-skip 0 --launch-count 8 \
       --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
       --section WarpStateStats ./build/bin/machmoe-bench --config $cfg $args > "$OUT/ncu_${cfg}_$side.log" 2>&1)
    echo "== ncu $cfg $side"
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|L2 Hit|Achieved Occupancy|Warp Cycles Per Issued|Registers Per" \
      "$OUT/ncu_${cfg}_$side.log" | grep -v "==PROF==" | cut -c1-110 | head -48
  done
done 2>&1 | tee "$OUT/ncu.txt" | grep -E "== ncu|place|Duration" | head -80
st "ncu"
bench() { timeout 30 ./build/bin/machmoe-bench --config "$1" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^  (forward|backward) |router_gemm|topk_scores|routing_metadata"; }
for cfg in ${AB_CFGS:-1.4B-256 7B-256 30B-256}; do
  for side in T N N T; do
    [ "$(left)" -gt ${AB_UNTIL:-380} ] || break 2
    echo "== $cfg topk $side"
    with_env "$(side_env $side)" bench $cfg
  done
done 2>&1 | tee "$OUT/ab.txt"
st "A/B rows"
win=$(python3 - "$OUT/ab.txt" <<'PY'
import re, sys, collections
t = collections.defaultdict(list); cur = None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) (\S+) ([TN])", line)
    if m: cur = (m[1], m[3]); continue
    m = re.match(r"\s+forward/routing_metadata\s+([\d.]+) ms", line)
    if m and cur: t[cur].append(float(m[1]))
mean = lambda xs: sum(xs) / len(xs) if xs else float("inf")
a, b = mean(t[("1.4B-256", "T")]), mean(t[("1.4B-256", "N")])
print("N" if b < a else "none")
print(f"routing_metadata 1.4B-256: T {a:.4f}  N {b:.4f}", file=sys.stderr)
PY
)
st "winner: $win"
if [ "$win" = N ] && [ "$(left)" -gt 250 ]; then
  SF='*/GpuRoutingMetadata.*:*GpuRoutingMetadataLayout.*one_tile*:*GpuRoutingMetadataLayout.*caller_256*:*GpuRoutingMetadataLayout.*topk_257*' OUT=$OUT bash scripts/ab.sh san > "$OUT/san_summary.txt" 2>&1 &
  san=$!
  OUT=$OUT timeout $(( $(left) - 15 )) bash scripts/ab.sh suites; st "suites exit $?"
  wait $san; cat "$OUT/san_summary.txt"
fi
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
