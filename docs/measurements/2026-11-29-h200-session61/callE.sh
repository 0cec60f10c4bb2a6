#!/usr/bin/env bash
# Session 61 call E: T7 (recompute against the default cache) on the rows the 12 main ones leave out: gpt-oss-20b and
# gpt-oss-120b (d = n = 2880) and the token-rounding sweep's (16384,4096,1024,256,4), top-K, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/ab.sh build | tail -n 2
st t7
for cfg in gptoss20b-2880 gptoss120b-2880 "tr4096=--T:16384:--d:4096:--n:1024:--E:256:--K:4"; do
  name=${cfg%%=*}; case "$cfg" in *=*) args=$(echo "${cfg#*=}" | tr ':' ' ');; *) args="--config $cfg";; esac
  for cache in preact input_only; do
    [ $(( $(date +%s) - S )) -lt 280 ] || continue
    timeout 60 ./build/bin/machmoe-bench $args --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
      > /tmp/o.txt 2>&1
    echo "== $name $cache rc=$? | $(grep -E '^  forward ' /tmp/o.txt | tr -s ' ') | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ')"
    cat /tmp/o.txt >> "$OUT/t7_rest_raw.txt"
  done
done 2>&1 | tee "$OUT/t7_rest.txt"
st done
