#!/usr/bin/env bash
# Prepared in session 92, not run yet: every Hopper epilogue with warp-private staging (warp_private_epilogues.diff,
# on top of session 92's main, where only the dH epilogue has it). The forward's activation epilogue (up-projection)
# and the store epilogue (down-projection, dX~) still stage each pass with the warpgroup's named barrier before and
# after it; with the diff each warp stages, stores (a 16-row TMA box) and reuses its own rows, and EpilogueStaging
# holds the one definition that the dH epilogue uses too. It compiles here (sm_90a, no spills on gptoss_swiglu's up
# kernels) but has not run on a GPU.
#
# One call (a fresh H200): main built and kept, the diff applied and built, then ncu cycles of the up-projection, the
# store epilogue's first launch of a run (the forward's down-projection) and the dH kernel (one launch each, sides A B B A) on the rows where the epilogue weighs most
# (the cooperative up-projection at d = 768 and 1536 runs its epilogue with the tensor cores idle: 0.82-0.93 of its
# cuBLAS GEMM in session 91) and on one 120B row. If the up-projection or the store kernels gain beyond ncu's 0.1-0.5 %
# repeatability: land the diff after the whole GPU suite (scripts/ab.sh build gboth, then pyg) and the sanitizers on
# the Hopper tests (SF='*Hopper*' bash scripts/ab.sh san, in its own call).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=docs/measurements/2026-12-03-session92-prepared
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build main; bash scripts/ab.sh build 2>&1 | grep -E "exit"; KEEP=main bash scripts/ab.sh keep | tail -n 1
st apply; AB_PATCH=$P/warp_private_epilogues.diff bash scripts/ab.sh apply 2>&1 | grep -E "exit|apply"
KEEP=new bash scripts/ab.sh keep | tail -n 1
# Every kernel family whose epilogue stages (the new dH test EveryCountOfAWarpsRows among them) before any timing.
st tests
timeout 170 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*HopperDh*:*HopperEdgeTiles*:*HopperUpProjection*:*HopperDownProjection*:*HopperDxExpanded*' \
  > "$OUT/ab_tests.log" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/ab_tests.log" | grep -E "FAILED|PASSED|tests ran" | head -20
for k in "EpilogueActivation<:1.4B-1024,7B-256" "EpilogueStore<:1.4B-256,7B-256" "EpilogueActivation<:120B-2048" "EpilogueActivationGrad:1.4B-256"; do
  [ $(( $(date +%s) - S )) -lt 520 ] || { echo "skipped ${k%%:*} (time)"; continue; }
  name=$(echo "${k%%:*}" | tr -dc 'A-Za-z')
  st "ncu ${k%%:*}"
  python3 scripts/ncu_ab.py run --kernel "${k%%:*}" --launches 1 --configs "${k#*:}" \
    --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/ab_ncu_$name.csv" \
    > "$OUT/ab_ncu_$name.log" 2>&1
  # (The table was also written to a file of $OUT when this ran; session 93 keeps those tables, renamed with its
  # call's prefix. Edited in session 104 to print it only: it is `ncu_ab.py table` of the csv.)
  echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/ab_ncu_$name.csv"
done
rm -f "$OUT"/build*.log
st done
