#!/usr/bin/env bash
# Session 82, call A (one H200, fresh): main (99b0c66, kernels of e6c6c02) built; memcheck and racecheck on the keys
# tests with the four-lane keys kernel (session 80 ran them on the two-lane version only); then T8 on the 12 main rows,
# both routings of each row back to back (300 ms windows), as far as the call's time allows; the table by
# scripts/t8_table.py. The top-K runs are also the main table's rows (forward, backward, efficiency, memory).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st sanitizers
for tool in memcheck racecheck; do
  MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests \
    --gtest_brief=1 --gtest_filter='*Bf16KeysRouteAsTheFp32KeysDo*:*E128_K8*:*padded_rows_bf16*' > "$OUT/callA_$tool.txt" 2>&1
  echo "$tool exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/callA_$tool.txt" | sort -u | tr '\n' ' ')"
done
st t8
: > "$OUT/callA_t8_raw.txt"
for row in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048; do
  [ $(( $(date +%s) - S )) -lt 545 ] || { echo "t8: out of time before $row"; break; }
  for routing in token_rounding topk; do
    timeout 40 ./build/bin/machmoe-bench --config "$row" --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/callA_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callA_t8_raw.txt" > "$OUT/callA_t8_table.md" 2>&1; cat "$OUT/callA_t8_table.md"
xz -f "$OUT/callA_t8_raw.txt"
st done
