#!/usr/bin/env bash
# Session 113: session 112's prepared_call4.sh (router_topk_hopper.diff, the router GEMM with top-K in the Hopper
# kernel's epilogue), with its winner regex fixed (it matched sides A, B, C; the sides are A, H, M) and split in two
# calls, as the whole GPU suite alone takes about five minutes:
#   bash call1.sh measure   the routing gtests as a gate, A H H A on four rows (300 ms windows; $SIDES), ncu of H
#                           ($NCU_SIDES); M, measured in session 112, is left out by default
#   bash call1.sh land      the whole GPU suite (scripts/ab.sh suites) with compute-sanitizer on the new test beside
#                           it, then every main row with top-K while time is left
# The diff is applied to the checkout and built on the development machine; build/bin, build/lib and
# build/tests/machmoe_gpu_tests are carried. Sides (MACHMOE_ROUTER_TOPK_FUSED): A = 0 (cuBLAS's router GEMM + the
# top-K kernel, main's path), H = unset (the Hopper kernel, the diff's default), M = mma (session 112's mma.sync
# kernel, 4 x 2 warps).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
left() { echo $(( ${CALL_S:-575} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
[ -f src/gpu/hopper/epilogue_router_topk.cuh ] || { echo "apply router_topk_hopper.diff first"; exit 2; }
if ! ./build/bin/machmoe-bench --help > /dev/null 2>&1; then
  lib=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  ./build/bin/machmoe-bench --help > /dev/null 2>&1 || { ./build/bin/machmoe-bench --help 2>&1 | head -5; exit 3; }
  echo "binaries start with $lib on the library path"
fi
mode=${1:-measure}
if [ "$mode" = measure ]; then
timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuRoutingMetadata*:GpuStageTiming.*' 2>&1 |
  grep -E "PASSED|FAILED|tests ran|Failure" | head -20
st "routing gtests"
bench() { timeout 30 ./build/bin/machmoe-bench --config "$1" --routing "$2" --warmup-ms 300 --time-ms 300 2>&1 |
  grep -E "^  (forward|backward) |router_gemm|router_topk|topk_scores|routing_metadata|forward/token_rounding"; }
side_env() { case $1 in A) echo MACHMOE_ROUTER_TOPK_FUSED=0;; H) echo MACHMOE_ROUTER_TOPK_SIDE=H;; M) echo "MACHMOE_ROUTER_TOPK_FUSED=mma MACHMOE_ROUTER_TOPK_WARPS=4";; esac; }
for run in 1.4B-256:topk 7B-256:topk 7B-512:topk 1.4B-512:topk; do
  for side in ${SIDES:-A H H A}; do
    [ "$(left)" -gt 200 ] || break 2
    echo "== ${run%%:*} ${run#*:} $side"
    (export $(side_env $side); bench ${run%%:*} ${run#*:})
  done
done 2>&1 | tee "$OUT/ab.txt"
st "A/B rows"
for side in ${NCU_SIDES:-H}; do
  [ "$(left)" -gt 100 ] || break
  env $(side_env $side) timeout 60 ncu --clock-control none --kernel-name-base mangled -k "regex:RouterTopK|topk|TNT" --launch-skip 2 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section ComputeWorkloadAnalysis \
    ./build/bin/machmoe-bench --config 1.4B-256 --routing topk --iters 1 --warmup 3 --warmup-ms 0 --time-ms 0 \
    --stage-runs 1 > "$OUT/ncu_$side.log" 2>&1
  echo "== ncu $side"; grep -E "^  [a-zA-Z_].*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Thr|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Waves Per SM|Block Limit|Issue Slots Busy|Stall|Warp Cycles Per Issued" "$OUT/ncu_$side.log" | grep -v "==PROF==" | cut -c1-130 | head -60
done 2>&1 | tee "$OUT/ncu.txt"
st "ncu"
# The winner, from the 1.4B-256 top-K rows: the fused side with the smallest mean router_topk, if below A's mean sum.
win=$(python3 - "$OUT/ab.txt" <<'PY'
import re, sys, collections
t = collections.defaultdict(list); side = None; cur = None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) (\S+) ([AHM])", line)
    if m: cur = (m[1], m[2], m[3]); t[cur].append({}); continue
    m = re.match(r"\s+forward/(router_gemm|topk_scores|router_topk)\s+([\d.]+) ms", line)
    if m and cur: t[cur][-1][m[1]] = float(m[2])
mean = lambda xs: sum(xs) / len(xs) if xs else float("inf")
a = mean([r.get("router_gemm", 0) + r.get("topk_scores", 0) for r in t[("1.4B-256", "topk", "A")]])
fused = {s: mean([r["router_topk"] for r in t[("1.4B-256", "topk", s)] if "router_topk" in r]) for s in "HM"}  # M: inf when not run
print("H" if fused["H"] < a else "none", file=sys.stdout)
print(f"A {a:.4f}  H {fused['H']:.4f}  M {fused['M']:.4f}", file=sys.stderr)
PY
)
st "winner: $win"
fi
if [ "$mode" = land ]; then
SF='GpuRoutingMetadataTopK.RouterTopKInTheHopperEpilogue' OUT=$OUT bash scripts/ab.sh san > "$OUT/san_summary.txt" 2>&1 &
san=$!
OUT=$OUT bash scripts/ab.sh suites; st "suites done"
wait $san; cat "$OUT/san_summary.txt"
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) ./build/bin/machmoe-bench --routing topk --warmup-ms 200 --time-ms 200 --all-configs \
    --cache preact --json "$OUT/all_topk.json" > "$OUT/all_topk.log" 2>&1
  st "all rows exit $?"
  python3 scripts/bench_tables.py passes "$OUT/all_topk.json"; echo
  python3 scripts/bench_tables.py stages "$OUT/all_topk.json"
fi
fi
st total
(cd "$OUT" && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
