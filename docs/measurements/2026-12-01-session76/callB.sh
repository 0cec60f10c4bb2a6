#!/usr/bin/env bash
# Session 76, call B (one H200): build 8078dab (the weight-gradient epilogue's staging in one helper: SASS identical),
# the whole gtest GPU suite in two shards side by side, then T14's module-against-C++ figures on the 12 main rows
# (isolated mode, T14's figure) as far as the call's time allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 2
st gtest; bash scripts/ab.sh gboth 2>&1 | grep -v "^\[" ; grep -h "FAILED\|Failure" "$OUT"/gtest_g*.log | head -n 20
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 3 > "$OUT/callB_gtest_g${i}_tail.txt"; done
xz -f "$OUT"/gtest_g*.log
st overhead
left=$(( 575 - ($(date +%s) - S) ))
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout "$left" \
  python3 -m machmoe.benchmark.overhead --configs main --modes isolated --json "$OUT/callB_overhead.json" \
  > "$OUT/callB_overhead.txt" 2>&1
echo "overhead exit $?"; tail -n 16 "$OUT/callB_overhead.txt"
st done
