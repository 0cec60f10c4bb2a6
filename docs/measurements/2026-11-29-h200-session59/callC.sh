#!/usr/bin/env bash
# Session 59 call C: a -lineinfo build; ncu --set full (stalls by instruction) of the up-projection and the dH kernel on
# 1.4B-256 and 7B-256; the up-projection on the square ping-pong tile; the overhead GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st detail-up
KERNEL_REGEX='EpilogueActivation<' PROFILE_TAG=up LAUNCHES=1 DETAIL_TIMEOUT=150 BENCH_CONFIGS="1.4B-256 7B-256" \
  bash scripts/gpu_check.sh detail 2>&1 | grep -v "HGMMA" | tail -n 60
mv "$OUT/detail.tar.xz" "$OUT/detail_up.tar.xz"
st detail-dh
KERNEL_REGEX='EpilogueActivationGrad' PROFILE_TAG=dh LAUNCHES=1 DETAIL_TIMEOUT=150 BENCH_CONFIGS="1.4B-256 7B-256" \
  bash scripts/gpu_check.sh detail 2>&1 | grep -v "HGMMA\|^machmoe\|^\[" | tail -n 60
mv "$OUT/detail.tar.xz" "$OUT/detail_dh.tar.xz"
st tile128
for cfg in 1.4B-256 7B-256; do
  MACHMOE_HOPPER_TILE_N=128 ./build-lineinfo/bin/machmoe-bench --config $cfg --routing topk --iters 10 --warmup 3 --stage-runs 3 \
    --warmup-ms 300 --time-ms 300 > "$OUT/tile128_$cfg.txt" 2>&1
  echo "== $cfg tile 128"; grep -E "^  (forward|backward) |up_projection|dh_kernel" "$OUT/tile128_$cfg.txt"
done
st pytest
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build-lineinfo/lib/libmachmoe_torch.so timeout 200 python3 -m pytest -q \
  -p no:cacheprovider tests/python/test_overhead_gpu.py > "$OUT/pytest_overhead.log" 2>&1
echo "pytest exit $?"; tail -n 3 "$OUT/pytest_overhead.log"
st done
