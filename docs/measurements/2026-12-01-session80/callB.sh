#!/usr/bin/env bash
# Session 80, call B (one H200): the keys kernel with Lanes lanes a token. Build this checkout (four lanes a token where
# E > 64, two below) and three variants of token_rounding_kernels.cu: main's (the warp kernel), call A's (two lanes
# for every row of <= 128 experts, fed56b1) and four lanes for every such row. The token-rounding and router GPU tests
# and session 48's equivalence harness on this checkout's version; ncu cycles of the keys kernel, the four sides in
# turn (A B C D D C B A) on four rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/token_rounding_kernels.cu \
  VARIANTS="main=third_party/variants/tr_main.cu lanes2=third_party/variants/tr_lanes2.cu all4=third_party/variants/tr_all4.cu" \
  bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st "tests"
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*TokenRounding*:GpuRouterKernels.*:*TopKOnTheGpuLogits*' > "$OUT/callB_tests.txt" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/callB_tests.txt" | grep -E "FAILED|PASSED|Failure|differ" | head -n 20
st equivalence
mkdir -p /tmp/base_src/src/gpu && cp third_party/variants/tr_main.cu /tmp/base_src/src/gpu/token_rounding_kernels.cu
BASE_SEL=1 BASE_SRC=/tmp/base_src timeout 150 bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh \
  > "$OUT/callB_equivalence.txt" 2>&1; echo "equivalence exit $?"; tail -n 3 "$OUT/callB_equivalence.txt"
st ncu
timeout 200 python3 scripts/ncu_ab.py run --kernel tr_keys --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-512,1.4B-1024 --side main@/tmp/bench_main --side lanes2@/tmp/bench_lanes2 \
  --side all4@/tmp/bench_all4 --side new@/tmp/bench_new --rounds 1 \
  --out "$OUT/callB_ncu.csv" -- --routing token_rounding > /dev/null 2>&1; echo "ncu exit $?"
[ -f "$OUT/callB_ncu.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callB_ncu.csv" | tee "$OUT/callB_ncu_table.md"
xz -f "$OUT/callB_ncu.csv"
st "routing stage"
for row in 1.4B-256 7B-256; do for side in lanes2 new new lanes2; do
  [ $(( $(date +%s) - S )) -lt 560 ] || break 2
  timeout 20 /tmp/bench_$side --config $row --routing token_rounding --warmup-ms 200 --time-ms 200 --iters 10 \
    --warmup 3 --stage-runs 1 2>/dev/null | grep -E "forward/token_rounding" | awk -v r=$row -v s=$side '{print r, s, $0}'
done; done | tee "$OUT/callB_stage.txt"
rm -f "$OUT"/build*.log
st done
