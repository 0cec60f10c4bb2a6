#!/usr/bin/env bash
# Session 85, call 2 (one H200, fresh). Call 1's version waited for each of a row's 16 loads in turn (a T-typed select
# per slot); here the bf16 rows load as bits, every load issued before the first use, write_block_keys multiplies the
# unchosen keys (exponentials in the tile) by the token's reciprocal sum as it writes them, and the logits copy is
# stored from the row's registers. Sides: main (main's file, third_party/variants/tr_main.cu) and new (this checkout).
# ncu of the keys kernel on three rows first; if new is faster at E = 512, the whole gtest GPU suite on new (two
# shards side by side, failures printed); else ncu of two intermediate versions (inplace: the probability keys made
# in the tile by the token's lanes; b: new without the copy from registers) to see which part lost.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st variants
VARIANTS="main=third_party/variants/tr_main.cu" bash scripts/ab.sh variants 2>&1 | grep -E "exit"
KEEP=new bash scripts/ab.sh keep | grep kept
E512="E512=--T:16384:--d:1536:--n:256:--E:512:--K:8"
E256="E256=--T:16384:--d:4096:--n:1024:--E:256:--K:4"
st ncu
KCFGS="$E512 30B-256 $E256" NSIDES="main new" NREPS=1 KLC=1 KRX=tr_keys bash scripts/ab.sh ncu > /dev/null 2>&1
cp "$OUT/ncu.txt" "$OUT/call2_ncu.txt"; grep -E "^-- |gpu__time|sm__inst|registers" "$OUT/call2_ncu.txt" | head -60
us() { grep -A3 "^-- E512 $1 " "$OUT/call2_ncu.txt" | grep gpu__time | head -1 | awk '{print $3}'; }
faster=$(python3 -c "print(1 if float('$(us new)' or 9e9) < float('$(us main)' or 0) else 0)")
if [ "$faster" = 1 ]; then
  st gboth; bash scripts/ab.sh gboth 2>&1 | grep -vE "^\[[0-9]+s\]"
  grep -h -A8 "Failure" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" | grep -v "reference GEMM" | head -60
  grep -h "FAILED  \]" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" | head
  tail -n 2 "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" > "$OUT/call2_suite_summary.txt"
  grep -v "reference GEMM" "$OUT/gtest_g0.log" "$OUT/gtest_g1.log" | grep -E "Failure|FAILED" -A8 > "$OUT/call2_failures.txt"
else
  st "new not faster: intermediate versions"
  VARIANTS="inplace=third_party/variants/tr_inplace.cu b=third_party/variants/tr_b.cu" bash scripts/ab.sh variants 2>&1 | grep -E "exit"
  rm -f "$OUT/ncu.txt"
  KCFGS="$E512 30B-256" NSIDES="main inplace b new" NREPS=1 KLC=1 KRX=tr_keys bash scripts/ab.sh ncu > /dev/null 2>&1
  cp "$OUT/ncu.txt" "$OUT/call2_ncu_variants.txt"; grep -E "^-- |gpu__time|sm__inst" "$OUT/call2_ncu_variants.txt"
fi
rm -f "$OUT/ncu.txt" "$OUT"/build*.log "$OUT"/gtest_g*.log
st done
