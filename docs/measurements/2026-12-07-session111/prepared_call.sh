#!/usr/bin/env bash
# Prepared in session 111, never run: one device call for router_topk_fused_v2.diff (session 111's measured diff with
# the kernel's main loop made branch-free: E rounded up to 32, 64 or 128 as a template parameter, so the compiler
# issues the next B fragments' ldmatrix while earlier MMAs run, as the SASS read in session 111 shows; and the
# largest shared-memory carveout requested, for two CTAs an SM).
# Before the call, on the development machine: `patch -p1 < docs/measurements/2026-12-07-session111/router_topk_fused_v2.diff`
# and either `bash scripts/build.sh` there (about 6.5 minutes on 2 cores; carry build/bin, build/lib and
# build/tests/machmoe_gpu_tests) or carry third_party and let this script build (about 100 s on the device).
#   the routing gtests as a gate; machmoe-bench B A A B (A: MACHMOE_ROUTER_TOPK_FUSED=0, cuBLAS + the top-K kernel);
#   the whole GPU suite (scripts/ab.sh suites: gtest in 6 shards, pytest in 3 processes) with compute-sanitizer on
#   the kernel's test beside it; every main row with top-K with what is left of CALL_S.
# Land only if B's router_topk stage is below A's router_gemm + topk_scores on the rows measured and the forward is
# not slower; else keep the diff and take ncu (--clock-control none) of router_topk_kernel on 1.4B-256.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
[ -f src/gpu/router_topk_fused.cu ] || { echo "apply router_topk_fused_v2.diff first"; exit 2; }
if [ ! -x build/tests/machmoe_gpu_tests ]; then
  MACHMOE_JOBS=$(nproc) bash scripts/build.sh > "$OUT/build.log" 2>&1; st "build exit $?"
fi
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:GpuStageTiming.*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -20
st "routing gtests"
bench() { timeout 30 ./build/bin/machmoe-bench --config "$1" --routing "$2" --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^  (forward|backward) |router_gemm|router_topk|topk_scores|routing_metadata|forward/token_rounding"; }
for run in 1.4B-256:topk 7B-512:topk 1.4B-256:token_rounding 7B-256:topk 1.4B-1024:topk; do
  for side in B A A B; do
    [ "$(left)" -gt 330 ] || break 2
    echo "== ${run%%:*} ${run#*:} $side"
    if [ $side = B ]; then bench ${run%%:*} ${run#*:}; else MACHMOE_ROUTER_TOPK_FUSED=0 bench ${run%%:*} ${run#*:}; fi
  done
done
st "A/B rows"
SF='GpuRoutingMetadataTopK.RouterGemmAndTopKInOneKernel' OUT=$OUT bash scripts/ab.sh san > "$OUT/san_summary.txt" 2>&1 &
san=$!
OUT=$OUT bash scripts/ab.sh suites; st "suites done"
wait $san; cat "$OUT/san_summary.txt"
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) ./build/bin/machmoe-bench --routing topk --warmup-ms 200 --time-ms 200 --all-configs \
    --cache preact --json "$OUT/all_topk.json" > "$OUT/all_topk.log" 2>&1
  st "all rows exit $?"
  python3 scripts/bench_tables.py passes "$OUT/all_topk.json"; echo
  python3 scripts/bench_tables.py stages "$OUT/all_topk.json"
fi
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
