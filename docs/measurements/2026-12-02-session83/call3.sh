#!/usr/bin/env bash
# Session 83, call 3 (warm after call 2, else it builds): compute-sanitizer memcheck and racecheck on token-rounding
# kernel tests that take the changed emit (E <= 32) and select (every E); then T8 on the 12 main rows, both routings
# of each row back to back (300 ms windows), as far as the call's time allows; the table by scripts/t8_table.py.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
if [ ! -x build/bin/machmoe-bench ] || [ ! -x build/tests/machmoe_gpu_tests ]; then
  st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
fi
st sanitizers
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter='*GpuTokenRoundingKernels*E8_K1*:*T12289_E16*:*exact_ties_T3000*:*E128_K8*:*T_below_tile*' \
    > "$OUT/call3_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/call3_$tool.txt" | sort -u | tr '\n' ' ')"
done
st t8
: > "$OUT/call3_t8_raw.txt"
for row in 1.4B-1024 1.4B-512 1.4B-256 7B-1024 7B-512 7B-256 30B-1024 30B-512 30B-256 120B-2048 120B-1024 120B-512; do
  [ $(( $(date +%s) - S )) -lt 555 ] || { echo "t8: out of time before $row"; break; }
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --config "$row" --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/call3_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/call3_t8_raw.txt" > "$OUT/call3_t8_table.md" 2>&1; cat "$OUT/call3_t8_table.md"
xz -f "$OUT/call3_t8_raw.txt"
st done
