#!/usr/bin/env bash
# Session 108's prepared device calls for topk_histograms.diff (the top-K kernel writing the metadata's tile
# histograms, the metadata chain as programmatic dependent launches, two host-side SM-count lookups). Never run:
# after call 1, ten tries got no machine and the eleventh was refused for too little device time.
#   bash prepared_call.sh measure   build; the routing gtests, the new one included; four small rows, top-K, 300 ms
#                                   windows (their routing stages against call 1's and session 107's on an H100);
#                                   TorchTitanGroupedExperts' copies (session 109's torchtitan_in_place.py, which
#                                   replaced this session's torchtitan_copies.py and measures that form too)
#   bash prepared_call.sh land      build; the whole gtest GPU suite's two shards beside pytest's GPU tests;
#                                   compute-sanitizer on the routing tests; every main row (tables on stdout)
# Both apply the diff first unless the tree has it already (the device copy has no .git: patch, not git apply).
set -uo pipefail
stage="${1:?usage: bash prepared_call.sh measure|land}"
cd "$(dirname "$0")/../../.."
here=docs/measurements/2026-12-07-session108
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
if patch -p1 -N -s --dry-run < "$here/topk_histograms.diff" > /dev/null 2>&1; then
  patch -p1 -N -s < "$here/topk_histograms.diff" && st "applied topk_histograms.diff"
fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
MACHMOE_JOBS=16 bash scripts/build.sh > /tmp/build.log 2>&1; st "build exit $?"
grep -E " error|FAILED" /tmp/build.log | head
case "$stage" in
  measure)
    timeout 90 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:*TopK*' 2>&1 |
      grep -E "PASSED|FAILED" | head -10
    st "routing gtests"
    for cfg in 1.4B-256 7B-256 7B-512 1.4B-1024; do
      timeout 30 ./build/bin/machmoe-bench --config $cfg --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
        grep -E "^config|^  (forward|backward) |router_gemm|topk|routing_metadata"
    done
    st "small rows"
    MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 70 \
      python3 docs/measurements/2026-12-07-session109/torchtitan_in_place.py
    st "torchtitan exit $?";;
  land)
    OUT=$OUT bash scripts/ab.sh pyg > /dev/null 2>&1 &
    pyg=$!
    OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
    wait $pyg; st "suites done"
    tail -n 2 "$OUT/pytest_gpu.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
    SF='GpuRoutingMetadataTopK.*:GpuRoutingMetadata/*' OUT=$OUT timeout 120 bash scripts/ab.sh san
    timeout 120 ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs --cache preact \
      --json "$OUT/all_preact.json" > /dev/null 2>&1
    st "all rows exit $?"
    python3 scripts/bench_tables.py passes "$OUT/all_preact.json"; echo
    python3 scripts/bench_tables.py stages "$OUT/all_preact.json";;
  *) echo "prepared_call.sh: unknown stage '$stage' (measure or land)" >&2; exit 2;;
esac
st total
