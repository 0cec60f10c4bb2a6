#!/usr/bin/env bash
# Session 108, call 2 (prepared, never run: after call 1 ten tries got no machine and the eleventh was refused for
# too little device time): the prepared change topk_histograms.diff (the top-K kernel writing the metadata's tile histograms, the metadata
# chain as programmatic dependent launches, two host-side SM-count lookups) applied to the landed code. Build; the
# routing gtests, the new one included; four small rows, top-K, 300 ms windows (their routing stages against call 1's
# and session 107's on the same kind of H100); TorchTitanGroupedExperts' copies (torchtitan_copies.py). The whole
# GPU suite is left for the session that lands the change.
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=docs/measurements/2026-12-07-session108
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
# The prepared change, unless the tree has it already (the device copy has no .git: patch, not git apply).
diff=docs/measurements/2026-12-07-session108/topk_histograms.diff
if patch -p1 -N -s --dry-run < "$diff" > /dev/null 2>&1; then patch -p1 -N -s < "$diff" && st "applied $diff"; fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > /tmp/build_new.log 2>&1; st "build exit $?"
tail -n 1 /tmp/build_new.log; grep -E " error|FAILED" /tmp/build_new.log | head
timeout 90 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:*TopK*' \
  > "$OUT/gtest_routing_call2.log" 2>&1
st "routing gtest exit $?"; grep -E "PASSED|FAILED" "$OUT/gtest_routing_call2.log" | head -10
for cfg in 1.4B-256 7B-256 7B-512 1.4B-1024; do
  timeout 30 ./build/bin/machmoe-bench --config $cfg --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
    grep -E "^config|^  (forward|backward) |router_gemm|topk|routing_metadata"
done > "$OUT/small_rows_call2.txt"
st "small rows done"; cat "$OUT/small_rows_call2.txt"
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 70 \
  python3 $here/torchtitan_copies.py > "$OUT/torchtitan_copies_call2.txt" 2>&1
st "torchtitan exit $?"; cat "$OUT/torchtitan_copies_call2.txt"
st total
