#!/usr/bin/env bash
# Session 115, call 2: does the place kernel sorting blocks of 2048 pairs (place_sorted_kernel, session 113's
# place_sorted.diff as landed, its whole GPU suite passed in call 1) leave the forward slower on 1.4B (256,128,8)?
# Call 1's forward there read N 3-7 us above T while its routing_metadata stage read 4 us below, two passes each.
# Carry build/bin (the landed code's build). T = MACHMOE_PLACE_BY_TILE=1 (the per-tile kernel), N = unset.
# machmoe-bench, top-K, 300 ms windows: T N N T T N N T on 1.4B (256,128,8), T N N T on 7B (512,64,4).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
bench() {  # side, config
  local vars=""
  [ "$1" = T ] && vars=MACHMOE_PLACE_BY_TILE=1
  with_env "$vars" timeout 30 ./build/bin/machmoe-bench --config "$2" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
    grep -E "^  (forward|backward) |topk_scores|routing_metadata"
}
for cfg in "1.4B-256:T N N T T N N T" "7B-512:T N N T"; do
  for side in ${cfg#*:}; do echo "== ${cfg%%:*} topk $side"; bench $side ${cfg%%:*}; done
done 2>&1 | tee "$OUT/ab.txt"
st total
