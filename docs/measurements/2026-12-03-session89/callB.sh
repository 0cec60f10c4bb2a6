#!/usr/bin/env bash
# Session 89, call B (fresh machine): (1) where the small rows' timed backward spends its ~0.1 ms over its stages:
# machmoe-bench --profile's diagnostics on five main rows (each pass back to back, behind a busy kernel, and called
# alone with its stages against the queued stages); (2) ncu cycles of the expert GEMMs of one forward + backward,
# main against session 88's prefetched router-term epilogue (docs/measurements/2026-12-03-session88-prepared/).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
pre=callB
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st profile
for cfg in 1.4B-256 7B-256 1.4B-1024 30B-256 120B-2048; do
  ./build/bin/machmoe-bench --config "$cfg" --routing topk --warmup-ms 300 --time-ms 300 --profile \
    > "$OUT/${pre}_profile_$cfg.txt" 2>&1
  echo "$cfg exit $?"
  grep -E "^  (forward|backward) |add up|back-to-back|behind a busy|called alone" "$OUT/${pre}_profile_$cfg.txt"
  grep -E "alone .* ms, queued" "$OUT/${pre}_profile_$cfg.txt" | awk '{d=$NF+0; if (d > 0.003 || d < -0.003) print}'
done
st keep; KEEP=main bash scripts/ab.sh keep 2>&1 | tail -n 1
st apply; AB_PATCH=docs/measurements/2026-12-03-session88-prepared/router_term_prefetched.diff bash scripts/ab.sh apply 2>&1 | tail -n 3
st ncu
python3 scripts/ncu_ab.py run --kernel MainloopVarlenM --launches 7 --configs 1.4B-256,7B-256,30B-512 \
  --side main@/tmp/bench_main --side pre@build/bin/machmoe-bench --rounds 1 --out "$OUT/${pre}_ncu_varlen_m.csv" \
  -- --routing topk
echo "ncu exit $?"
python3 scripts/ncu_ab.py table "$OUT/${pre}_ncu_varlen_m.csv" | tee "$OUT/callB_ncu_varlen_m_table.md"
grep -o '"[^"]*MainloopVarlenM[^"]*"' "$OUT/${pre}_ncu_varlen_m.csv" | sort | uniq -c | cut -c1-400 > "$OUT/${pre}_ncu_kernel_names.txt"
xz -9 "$OUT/${pre}_ncu_varlen_m.csv"
st done
