#!/usr/bin/env bash
# Session 60 call B: split rings for the gathered A (mainloop_varlen_m.cuh: A's ring deeper than the weights', B
# issued kLagB k-blocks behind A) against main. Sides: main (HEAD before the change, built from .gl/base60.tar in the
# background), v1 (this checkout: ping-pong A 7 / B 3 stages, cooperative 6 / 3), v2 (.gl/tile_config_v2.hpp:
# 6 / 4 and 5 / 3). A correctness smoke of the Hopper up-projection and dH tests on v1 first.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AB_BASE_TAR=.gl/base60.tar bash scripts/ab.sh basebg build | tail -n 2
cp build/bin/machmoe-bench /tmp/bench_v1
st smoke
timeout 100 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*HopperUpProjection*:*HopperDhKernel*:*HopperEdgeTiles*:*HopperSchedulerProperties*' > "$OUT/smoke_v1.log" 2>&1
echo "smoke exit $?"; grep -v "reference GEMM" "$OUT/smoke_v1.log" | tail -n 3
st v2
cp .gl/tile_config_v2.hpp src/gpu/hopper/tile_config.hpp && touch src/gpu/hopper/tile_config.hpp
cmake --build build --target machmoe-bench > "$OUT/build_v2.log" 2>&1; echo "v2 build exit $?"
cp build/bin/machmoe-bench /tmp/bench_v2; git checkout src/gpu/hopper/tile_config.hpp
bash scripts/ab.sh basewait | tail -n 1; cp /tmp/base/build/bin/machmoe-bench /tmp/bench_main
one() {  # side cfg
  timeout ${3:-40} /tmp/bench_$1 --config $2 --routing topk --iters 10 --warmup 3 --stage-runs 3 --warmup-ms 200 --time-ms 200 \
    > /tmp/o.txt 2>&1; rc=$?
  echo "== $2 $1 rc=$rc | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | up $(grep up_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4) | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4)"
  cat /tmp/o.txt >> "$OUT/split_ring_raw.txt"
}
st ab
for r in 1 2; do for cfg in 1.4B-256 7B-256; do for side in main v1 v2; do one $side $cfg; done; done; done 2>&1 | tee "$OUT/split_ring.txt"
for side in main v1 v2; do one $side 30B-256 60; done 2>&1 | tee -a "$OUT/split_ring.txt"
st done
