#!/usr/bin/env bash
# Session 83, call 1 (one H200, fresh): token rounding's emit with 8 tokens a warp where E <= 64 (one wave where 2
# tokens a warp took 2.4 at T = 40960) and the bounded select's short radix select with two barriers a pass and its
# step-1 bound from three passes. Sides: orig (main's file), p4 (the new file with the bound's fourth pass back), w4
# (8 tokens a warp up to E = 128 too), new (this checkout). The token-rounding GPU tests on new; ncu kernel times of
# the four sides on three 1.4B rows; T8's comparison (both routings) of orig and new on four small rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st variants
VARIANTS="orig=third_party/variants/tr_orig.cu p4=third_party/variants/tr_p4.cu w4=third_party/variants/tr_w4.cu" \
  bash scripts/ab.sh variants 2>&1 | grep -E "exit"
KEEP=new bash scripts/ab.sh keep | grep kept
st gf; bash scripts/ab.sh gf 2>&1 | tail -n 3
st ncu
KCFGS="1.4B-1024 1.4B-512 1.4B-256" NSIDES="orig p4 w4 new" NREPS=1 KLC=4 bash scripts/ab.sh ncu > /dev/null 2>&1
cp "$OUT/ncu.txt" "$OUT/call1_ncu.txt"; grep -E "^-- |tr_|gpu__time" "$OUT/call1_ncu.txt" | head -80
st tab
TCFGS="1.4B-1024 1.4B-512 7B-1024 7B-512" SIDES="orig new" TAB_ARGS="--warmup-ms 300 --time-ms 300" \
  bash scripts/ab.sh tab > /dev/null 2>&1
cp "$OUT/tab.txt" "$OUT/call1_tab.txt"; grep -E "^== |forward/(token_rounding|topk)|^  (forward|backward) " "$OUT/call1_tab.txt" | head -100
rm -f "$OUT/ncu.txt" "$OUT/tab.txt"
st done
