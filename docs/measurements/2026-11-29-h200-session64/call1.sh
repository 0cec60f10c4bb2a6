#!/usr/bin/env bash
# Session 64, call 1 (fresh lease): main (base, from $AB_BASE_TAR) and the dH epilogue's batched H loads built side by
# side; the dH kernel's GPU tests; the layer, base against new, on five rows, two rounds, 300 ms windows, order
# alternating (the dH stage and the backward); then the pytest GPU suite on the new build.
#   git archive --prefix=base/ main -o base_main.tar -- . ':!docs'   (untracked, not ignored: it travels)
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export AB_BASE_TAR=${AB_BASE_TAR:-$PWD/base_main.tar}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_1.csv" 2>&1 &
SMI=$!
st "base (background) and new"
bash scripts/ab.sh basebg build | tail -n 2
st gtest
timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperDh*:HopperEdgeTiles.DhKernel*:GpuLayerProperties.WideDhTile*' 2>&1 |
  grep -v "reference GEMM" | tail -n 2
bash scripts/ab.sh basewait | tail -n 1
st layer
bench_of() { case $1 in base) echo /tmp/base/build/bin/machmoe-bench;; new) echo ./build/bin/machmoe-bench;; esac; }
one() {  # cfg side
  timeout 60 "$(bench_of $2)" --config $1 --routing topk --iters 5 --warmup 2 --stage-runs 5 --warmup-ms 300 \
    --time-ms 300 > /tmp/o.txt 2>&1
  echo "== $1 $2 rc=$? | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for r in 1 2; do for cfg in 1.4B-256 7B-256 30B-256 30B-1024 120B-2048; do
  order="base new"; [ $r = 2 ] && order="new base"
  for side in $order; do one $cfg $side; done
done; done 2>&1 | tee "$OUT/layer.txt"
st pytest
bash scripts/ab.sh pyg
kill $SMI
st done
