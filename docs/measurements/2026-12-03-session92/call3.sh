#!/usr/bin/env bash
# Session 92, call 3 (one H200, after call 2): compute-sanitizer (memcheck, racecheck) on the dH kernel's tests, which
# the warp-private epilogue's synchronisation changed (its edge-tile test included: the warps with partial rows take
# the predicated stores); pytest's one-GPU tests; then, as time allows, ncu cycles of the dH kernel against main's
# (dh_warp_epilogue.diff reverted and rebuilt) on two more rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=docs/measurements/2026-12-03-session92
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
[ -x build/tests/machmoe_gpu_tests ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
KEEP=new bash scripts/ab.sh keep | tail -n 1
st san; SF='*HopperDhKernel*:HopperEdgeTiles.DhKernelEveryActivation' bash scripts/ab.sh san 2>&1 | grep exit
for t in memcheck racecheck; do grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|tests ran" "$OUT/sanitize_$t.log" | sort -u; done > "$OUT/call3_sanitizer_summary.txt"
rm -f "$OUT"/sanitize_*.log
st pyg; bash scripts/ab.sh pyg 2>&1 | grep -vE "^\[[0-9]+s\]"
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call3_pytest_summary.txt"; grep -E "^FAILED" "$OUT/pytest_gpu.log" | head; rm -f "$OUT/pytest_gpu.log"
if [ $(( $(date +%s) - S )) -lt 450 ]; then
  st revert; AB_PATCH=$D/dh_warp_epilogue.diff bash scripts/ab.sh revert 2>&1 | grep -E "exit|apply"
  KEEP=main bash scripts/ab.sh keep | tail -n 1
  st ncu
  python3 scripts/ncu_ab.py run --kernel EpilogueActivationGrad --launches 1 --configs 30B-256,1.4B-256 \
    --side main@/tmp/bench_main --side new@/tmp/bench_new --timeout 60 --out "$OUT/call3_ncu_dh.csv" \
    > "$OUT/call3_ncu_dh.log" 2>&1
  # (This step never ran. Edited in session 104 to print the table only, as `ncu_ab.py table` of the csv.)
  echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/call3_ncu_dh.csv"
fi
rm -f "$OUT"/build*.log
st done
