#!/usr/bin/env bash
# Session 60 call A: session 59's L2 prefetch of the gathered rows through the load/store path
# (gathered_rows_l2_prefetch_lsu.diff: MACHMOE_HOPPER_PREFETCH_A = window in k-blocks, 0 = main's kernels;
# MACHMOE_HOPPER_PREFETCH_A_LSU=1 = one prefetch.global.L2 per row and k-block instead of one bulk prefetch a row),
# same build, alternating, two rounds; then the overhead GPU tests of main's Python (a9827f1).
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AB_PATCH=docs/measurements/2026-11-29-h200-session59/gathered_rows_l2_prefetch_lsu.diff bash scripts/ab.sh apply | tail -n 2
one() {  # cfg window lsu
  MACHMOE_HOPPER_PREFETCH_A=$2 MACHMOE_HOPPER_PREFETCH_A_LSU=$3 timeout 60 ./build/bin/machmoe-bench --config $1 --routing topk \
    --iters 10 --warmup 3 --stage-runs 3 --warmup-ms 200 --time-ms 200 > /tmp/o.txt 2>&1
  echo "== $1 w=$2 lsu=$3 | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep up_projection /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4) | $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-4)"
  cat /tmp/o.txt >> "$OUT/prefetch_lsu_raw.txt"
}
st ab
for r in 1 2; do for cfg in 1.4B-256 7B-256; do for v in "0 0" "4 1" "8 1"; do one $cfg $v; done; done; done 2>&1 | tee "$OUT/prefetch_lsu.txt"
st 30B
for v in "0 0" "4 1" "0 0" "4 1"; do one 30B-256 $v; done 2>&1 | tee -a "$OUT/prefetch_lsu.txt"
st pytest
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 200 python3 -m pytest -q \
  -p no:cacheprovider tests/python/test_overhead_gpu.py > "$OUT/pytest_overhead.log" 2>&1
echo "pytest exit $?"; tail -n 3 "$OUT/pytest_overhead.log"
st done
