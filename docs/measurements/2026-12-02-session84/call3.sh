#!/usr/bin/env bash
# Session 84, call 3 (warm after call 2, else it builds): T8's two token-rounding sweeps, (16384, 4096, 1024, E, 4)
# for E = 32..256 and (16384, 1536, 256, E, 8) for E = 64..512, both routings of each row back to back (300 ms
# windows); the table by scripts/t8_table.py.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
if [ ! -x build/bin/machmoe-bench ]; then
  st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
fi
st sweeps
: > "$OUT/call3_t8_sweeps_raw.txt"
for row in 16384:4096:1024:256:4 16384:4096:1024:32:4 16384:4096:1024:64:4 16384:4096:1024:128:4 \
           16384:1536:256:64:8 16384:1536:256:128:8 16384:1536:256:256:8 16384:1536:256:512:8; do
  [ $(( $(date +%s) - S )) -lt 555 ] || { echo "sweeps: out of time before $row"; break; }
  IFS=: read -r t d n e k <<< "$row"
  for routing in token_rounding topk; do
    timeout 60 ./build/bin/machmoe-bench --T "$t" --d "$d" --n "$n" --E "$e" --K "$k" --warmup-ms 300 --time-ms 300 \
      --routing "$routing" --iters 10 --warmup 3 --stage-runs 3 >> "$OUT/call3_t8_sweeps_raw.txt" 2>&1
  done
done
python3 scripts/t8_table.py "$OUT/call3_t8_sweeps_raw.txt" > "$OUT/call3_t8_sweeps_table.md" 2>&1
cat "$OUT/call3_t8_sweeps_table.md"
xz -f "$OUT/call3_t8_sweeps_raw.txt"
st done
