#!/usr/bin/env bash
# session 56, call A: base (7024fd6) and new built; token-rounding GPU tests; ncu of the bounded select base vs new;
# T8 rows sw512 / sw256 both sides both routings (300 ms windows); sanitizers on the new E = 300 cases
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
export AB_BASE_TAR=$PWD/.gl/base56.tar
bash scripts/ab_token_rounding.sh basebg build
GF="*TokenRounding*" bash scripts/ab_token_rounding.sh gf
bash scripts/ab_token_rounding.sh basewait
SW512="sw512=--T:16384:--d:1536:--n:256:--E:512:--K:8"
SW256="sw256=--T:16384:--d:4096:--n:1024:--E:256:--K:4"
KCFGS="$SW512 1.4B-256" KRX="tr_" KLC=4 bash scripts/ab_token_rounding.sh ncu > /dev/null
grep -E "^-- |select_bounded|gpu__time|registers" "$OUT/ncu.txt" | head -80
ROUNDS=2 SIDES="base new" TAB_ARGS="--warmup-ms 300 --time-ms 300" TCFGS="$SW512" bash scripts/ab_token_rounding.sh tab > /dev/null
SIDES=new TAB_ARGS="--warmup-ms 300 --time-ms 300" TCFGS="$SW256 30B-256" bash scripts/ab_token_rounding.sh tab > /dev/null
grep -E "^== |forward/(token_rounding|topk|routing)|^  (forward|backward) " "$OUT/tab.txt"
SF="*E300*" bash scripts/ab_token_rounding.sh san
cp "$OUT"/*.txt "$OUT"/*.log /dev/null 2>/dev/null; ls "$OUT"
