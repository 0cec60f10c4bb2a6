#!/usr/bin/env bash
# Session 81, call C (one H200): the keys kernel with four lanes a token for every bf16 row of <= 128 experts
# (tr_keys_lane_kernel<KMax>, the Lanes = 2 instantiations gone). Build, and main's token_rounding_kernels.cu (9d911bc,
# the warp kernel) as a variant; the token-rounding and router GPU tests; session 48's equivalence harness; the whole
# gtest GPU suite in two shards beside pytest's GPU tests; ncu cycles of the keys kernel, main and new (A B B A).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/token_rounding_kernels.cu VARIANTS="main=third_party/variants/tr_main.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st "whole suite"
bash scripts/ab.sh pyg > "$OUT/callC_pyg.txt" 2>&1 &
bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\] =="
wait; grep -vE "^\[[0-9]+s\] ==" "$OUT/callC_pyg.txt"
for i in 0 1; do grep -v "reference GEMM" "$OUT/gtest_g$i.log" | tail -n 3 > "$OUT/callC_gtest_g${i}_tail.txt"; done
grep -hE "FAILED|Failure" "$OUT"/gtest_g*.log | head -n 20
tail -n 3 "$OUT/pytest_gpu.log" > "$OUT/callC_pytest_gpu_tail.txt"
st equivalence
mkdir -p /tmp/base_src/src/gpu && cp third_party/variants/tr_main.cu /tmp/base_src/src/gpu/token_rounding_kernels.cu
BASE_SEL=1 BASE_SRC=/tmp/base_src timeout 120 bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh \
  > "$OUT/callC_equivalence.txt" 2>&1; echo "equivalence exit $?"; tail -n 3 "$OUT/callC_equivalence.txt"
st ncu
[ $(( $(date +%s) - S )) -lt 500 ] && timeout 80 python3 scripts/ncu_ab.py run --kernel tr_keys --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-512,1.4B-1024 --side main@/tmp/bench_main --side new@/tmp/bench_new --rounds 1 \
  --out "$OUT/callC_ncu.csv" -- --routing token_rounding > /dev/null 2>&1; echo "ncu exit $?"
[ -f "$OUT/callC_ncu.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callC_ncu.csv" | tee "$OUT/callC_ncu_table.md"
[ -f "$OUT/callC_ncu.csv" ] && xz -f "$OUT/callC_ncu.csv"
rm -f "$OUT"/gtest_g*.log "$OUT"/sanitize_*.log "$OUT"/build*.log
st done
