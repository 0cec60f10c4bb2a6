#!/usr/bin/env bash
# Session 78, call F (one H200): T8 on the other rows whose token-rounding router backward took the new register path
# (E <= 128): the four 30B and 120B main rows with E = 128 or 64 and the two sweep rows with E = 128, both routings
# back to back, 300 ms windows (as call E). The rows are run in order until the time guard.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st t8
: > "$OUT/callF_t8_raw.txt"
for row in 30B-1024 120B-2048 30B-512 120B-1024 16384:4096:1024:128:4 16384:1536:256:128:8; do
  [ $(( $(date +%s) - S )) -lt 250 ] || { echo "t8: out of time before $row"; break; }
  case "$row" in
    *:*) IFS=: read -r t d n e k <<< "$row"; args="--T $t --d $d --n $n --E $e --K $k";;
    *) args="--config $row";;
  esac
  for routing in token_rounding topk; do
    # shellcheck disable=SC2086
    timeout 40 ./build/bin/machmoe-bench $args --warmup-ms 300 --time-ms 300 --routing "$routing" --iters 10 \
      --warmup 3 --stage-runs 3 >> "$OUT/callF_t8_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/callF_t8_raw.txt" > "$OUT/callF_t8_table.md" 2>&1; cat "$OUT/callF_t8_table.md"
xz -f "$OUT/callF_t8_raw.txt"
st done
