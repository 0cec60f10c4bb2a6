#!/usr/bin/env bash
# session 56, call B: base c162d04 (select at 256 threads) vs new (zero kernel + keys as a dependent launch; emit
# with 4 tokens a warp for rows of 512); token-rounding GPU tests; ncu A/B; T8's table on the 14 rows (new);
# sw512 base/new two rounds; sanitizers on the E = 300 / 512 cases
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
export AB_BASE_TAR=$PWD/.gl/base56b.tar
bash scripts/ab_token_rounding.sh basebg build
GF="*TokenRounding*" bash scripts/ab_token_rounding.sh gf 2>&1 | tee "$OUT/gf.txt"
bash scripts/ab_token_rounding.sh basewait
SW512="sw512=--T:16384:--d:1536:--n:256:--E:512:--K:8"
SW256="sw256=--T:16384:--d:4096:--n:1024:--E:256:--K:4"
KCFGS="$SW512 1.4B-256 30B-256" KRX="tr_" KLC=5 bash scripts/ab_token_rounding.sh ncu > /dev/null
grep -E "^-- |tr_[a-z_]*kernel|gpu__time|registers" "$OUT/ncu.txt" | sed 's/(const.*//' | head -120
ROUNDS=2 SIDES="base new" TAB_ARGS="--warmup-ms 300 --time-ms 300" TCFGS="$SW512" bash scripts/ab_token_rounding.sh tab > /dev/null
mv "$OUT/tab.txt" "$OUT/tab_sw512_ab.txt"
grep -E "^== |forward/(token_rounding|topk|routing)" "$OUT/tab_sw512_ab.txt"
SIDES=new ROUTES="token_rounding topk" TAB_ARGS="--warmup-ms 300 --time-ms 300" \
  TCFGS="1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048 $SW256 $SW512" \
  bash scripts/ab_token_rounding.sh tab > /dev/null
python3 scripts/t8_table.py "$OUT/tab.txt" 2>&1 | tail -n 30
SF="*E300*:*E512*" bash scripts/ab_token_rounding.sh san
ls "$OUT"
