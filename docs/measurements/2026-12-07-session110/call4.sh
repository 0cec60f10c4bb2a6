#!/usr/bin/env bash
# Session 110, call 4: is the 1.4B (256,128,8) backward slower with the top-K kernel writing the tile histograms?
# Call 1 had B (with it) after A (without) in each round and read B's backward 2.037 / 2.042 ms against A's
# 2.006 / 2.019, while no backward kernel changed. Here the order alternates: B A A B B A, top-K, 300 ms windows.
# Tree B is the checkout (landed code, build/); tree A a copy with topk_histograms.diff reversed (/tmp/a). Then, with
# what is left of the call (CALL_S, default 280 s), T8's sweep row once more on B. Never ran: the device tool refused
# to start a machine for the 325 s of device time that were left.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-280} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
rm -rf /tmp/a && mkdir -p /tmp/a && tar --exclude=./build --exclude=./build-cpu --exclude=./build-gpu -cf - . | tar -xf - -C /tmp/a
(cd /tmp/a && patch -R -p1 -s < docs/measurements/2026-12-07-session108/topk_histograms.diff) && st "tree A reversed"
MACHMOE_JOBS=8 bash scripts/build.sh > /tmp/build_b.log 2>&1 & pb=$!
MACHMOE_JOBS=8 bash /tmp/a/scripts/build.sh > /tmp/build_a.log 2>&1; ea=$?
wait $pb; st "builds A exit $ea, B exit $?"
bench() { timeout 30 "$1"/build/bin/machmoe-bench --config 1.4B-256 --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^  (forward|backward) |topk_scores|routing_metadata|dh_kernel|dx_expanded|dx_aggregation|dw1|dw2|router"; }
i=0
for side in B A A B B A; do
  [ "$(left)" -gt 20 ] || break
  i=$((i + 1)); echo "== run $i side $side"
  if [ $side = A ]; then bench /tmp/a; else bench .; fi
done
st "A/B done"
if [ "$(left)" -gt 40 ]; then
  for routing in token_rounding topk; do
    timeout $(( $(left) / 2 )) ./build/bin/machmoe-bench --T 16384 --d 4096 --n 1024 --E 256 --K 4 --routing $routing \
      --warmup-ms 300 --time-ms 300 2>&1 | grep -E "^  (forward|backward) "
    echo "== sweep row $routing"
  done
fi
st total
