#!/usr/bin/env bash
# Session 92, call 1 (one H200, fresh): the dH epilogue with warp-private staging (dh_warp_epilogue.diff, in this
# checkout). Each warp of a consumer warpgroup loads its own 16 rows of H by TMA, computes dH in place and stores its
# rows of dH and A' by its own TMA stores, so the epilogue has no named barrier (ncu, session 76: named barriers 21 %
# of the wide tile's epilogue stall samples). Build, the dH kernel's GPU tests, both binaries kept (main's by
# reverting the diff), then ncu cycles of the dH kernel, sides alternating (A B B A).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=docs/measurements/2026-12-03-session92
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st tests
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*HopperDh*:*HopperEdgeTiles*:*GpuLayer*:*GpuEdgeShapes*:*GpuAccumulate*' > "$OUT/call1_tests.log" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/call1_tests.log" | grep -E "FAILED|PASSED|tests ran" | head -20
KEEP=new bash scripts/ab.sh keep | tail -n 1
st revert; AB_PATCH=$D/dh_warp_epilogue.diff bash scripts/ab.sh revert 2>&1 | grep -E "exit|apply"
KEEP=main bash scripts/ab.sh keep | tail -n 1
git apply $D/dh_warp_epilogue.diff && echo "new files back (not rebuilt)"
st ncu
python3 scripts/ncu_ab.py run --kernel EpilogueActivationGrad --launches 1 --configs 7B-256,120B-2048 \
  --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/call1_ncu_dh.csv" \
  > "$OUT/call1_ncu_dh.log" 2>&1
echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/call1_ncu_dh.csv" | tee "$OUT/call1_ncu_dh_table.md"
st done
