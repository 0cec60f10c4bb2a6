#!/usr/bin/env bash
# Session 81, call D (one H200): call C's equivalence and ncu steps, which call C's 600 s did not reach (its build,
# whole GPU suite and pytest passed). Build, main's token_rounding_kernels.cu as a variant; session 48's equivalence
# harness; ncu cycles of the keys kernel, main and new in turn (A B B A) on four rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
VARIANT_FILE=src/gpu/token_rounding_kernels.cu VARIANTS="main=third_party/variants/tr_main.cu" bash scripts/ab.sh variants 2>&1 | grep exit
cp build/bin/machmoe-bench /tmp/bench_new
st ncu
timeout 90 python3 scripts/ncu_ab.py run --kernel tr_keys --launches 1 \
  --configs 1.4B-256,7B-256,1.4B-512,1.4B-1024 --side main@/tmp/bench_main --side new@/tmp/bench_new --rounds 1 \
  --out "$OUT/callD_ncu.csv" -- --routing token_rounding > /dev/null 2>&1; echo "ncu exit $?"
[ -f "$OUT/callD_ncu.csv" ] && python3 scripts/ncu_ab.py table "$OUT/callD_ncu.csv" | tee "$OUT/callD_ncu_table.md"
[ -f "$OUT/callD_ncu.csv" ] && xz -f "$OUT/callD_ncu.csv"
st equivalence
mkdir -p /tmp/base_src/src/gpu && cp third_party/variants/tr_main.cu /tmp/base_src/src/gpu/token_rounding_kernels.cu
BASE_SEL=1 BASE_SRC=/tmp/base_src timeout $(( 440 - ($(date +%s) - S) )) \
  bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh > "$OUT/callD_equivalence.txt" 2>&1
echo "equivalence exit $?"; tail -n 3 "$OUT/callD_equivalence.txt"
rm -f "$OUT"/build*.log
st done
