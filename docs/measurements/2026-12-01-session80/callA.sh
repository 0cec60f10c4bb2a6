#!/usr/bin/env bash
# Session 80, call A (one H200): token rounding's keys kernel with two lanes a token (tr_keys_lane_kernel). Build, and
# main's token_rounding_kernels.cu as a variant (/tmp/bench_main); the token-rounding and router GPU tests; session
# 48's equivalence harness (forward and backward of token rounding, main's file against the new one, bitwise);
# memcheck and racecheck on the keys tests; ncu cycles of the keys kernel, main and new in turn (A B B A) on four
# rows; T8 on the six small rows with the new code (both routings back to back), then 1.4B (256,128,8) in turn.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/token_rounding_kernels.cu VARIANTS="main=third_party/variants/tr_main.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st "tests"
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='*TokenRounding*:GpuRouterKernels.*:*TopKOnTheGpuLogits*' > "$OUT/callA_tests.txt" 2>&1
echo "tests exit $?"; grep -v "reference GEMM" "$OUT/callA_tests.txt" | grep -E "FAILED|PASSED|Failure|differ" | head -n 20
st equivalence
mkdir -p /tmp/base_src/src/gpu && cp third_party/variants/tr_main.cu /tmp/base_src/src/gpu/token_rounding_kernels.cu
BASE_SEL=1 BASE_SRC=/tmp/base_src timeout 150 bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh \
  > "$OUT/callA_equivalence.txt" 2>&1; echo "equivalence exit $?"; tail -n 3 "$OUT/callA_equivalence.txt"
st sanitizers
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter='*Bf16KeysRouteAsTheFp32KeysDo*:*E128_K8*:*padded_rows_bf16*' > "$OUT/callA_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/callA_$tool.txt" | sort -u | tr '\n' ' ')"
done
st ncu
timeout 100 python3 scripts/ncu_ab.py run --kernel tr_keys --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-512,1.4B-1024 --side main@/tmp/bench_main --side new@/tmp/bench_new --rounds 1 \
  --out "$OUT/callA_ncu.csv" -- --routing token_rounding > /dev/null 2>&1; echo "ncu exit $?"
[ -f "$OUT/callA_ncu.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callA_ncu.csv" | tee "$OUT/callA_ncu_table.md"
st t8
: > "$OUT/callA_t8_raw.txt"
for row in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024; do
  [ $(( $(date +%s) - S )) -lt 440 ] || { echo "t8: out of time before $row"; break; }
  for routing in token_rounding topk; do
    timeout 40 /tmp/bench_new --config "$row" --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/callA_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callA_t8_raw.txt" > "$OUT/callA_t8_table.md" 2>&1; cat "$OUT/callA_t8_table.md"
xz -f "$OUT/callA_t8_raw.txt"
st "in turn"
for routing in token_rounding topk topk token_rounding; do
  [ $(( $(date +%s) - S )) -lt 560 ] || break
  timeout 30 /tmp/bench_new --config 1.4B-256 --warmup-ms 300 --time-ms 300 --routing $routing --iters 10 \
    --warmup 3 --stage-runs 1 2>/dev/null | grep -E "^  (forward|backward) " | awk -v x=$routing '{print x, $1, $2}'
done | tee "$OUT/callA_in_turn.txt"
bash scripts/ab.sh pack > /dev/null 2>&1
st done
