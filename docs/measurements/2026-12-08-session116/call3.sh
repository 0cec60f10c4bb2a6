#!/usr/bin/env bash
# Session 116, call 3 (call 2 found no machine, and the device time left could no longer hold it): only
# 120B (512,256,16), the one main row that PlaceKernel::kAuto sorts and no run had measured, T N N T
# (T = MACHMOE_PLACE_BY_TILE=1, N = the layer's choice: sorted), top-K, 300 ms windows. Carry build/bin (33e515e).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
for side in T N N T; do
  echo "== 120B-512 topk $side"; bench_routing "$([ $side = T ] && echo MACHMOE_PLACE_BY_TILE=1)" 120B-512
done 2>&1 | tee "$OUT/ab_call3.txt"
st total
