#!/usr/bin/env bash
# Session 61 call D: the whole gtest GPU suite (two shards side by side) on the final tree; then a second round of
# T7 (recompute against the default cache) on the five rows closest to its limit in call C, and T13's gpt-oss pairs
# (d = n = 2880 beside 2944), 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/ab.sh build | tail -n 2
st gboth
bash scripts/ab.sh gboth 2>&1 | grep -v "^\[" 
cp build/gpu-logs/gtest_g*.log "$OUT/" 2>/dev/null
run() {  # label args...
  local label=$1; shift
  timeout 60 ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 "$@" > /tmp/o.txt 2>&1
  echo "== $label rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  stages' /tmp/o.txt | sed 's/.*they add up to //')"
  cat /tmp/o.txt >> "$OUT/t7_t13_raw.txt"
}
st t13
for cfg in gptoss20b-2880 gptoss20b-2944 gptoss120b-2880 gptoss120b-2944; do run "$cfg" --config $cfg; done 2>&1 |
  tee "$OUT/t13.txt"
st t7
for cfg in 30B-512 30B-1024 120B-512 120B-1024 120B-2048; do for cache in preact input_only; do
  [ $(( $(date +%s) - S )) -lt 570 ] && run "$cfg $cache" --config $cfg --cache $cache
done; done 2>&1 | tee "$OUT/t7_round2.txt"
st done
