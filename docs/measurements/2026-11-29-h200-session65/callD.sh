#!/usr/bin/env bash
# Session 65, call D: machmoe-bench --profile on four rows, with the host's enqueue time of one call and one call
# timed behind a kernel holding the GPU (the host's latency before its first kernel hidden), beside the back-to-back
# and the one-timed-call figures of call B.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" --target machmoe-bench >> "$OUT/build.log" 2>&1
echo "build exit $?"; tail -n 1 "$OUT/build.log"
st profile
for cfg in ${CFGS:-1.4B-256 7B-256 1.4B-1024 30B-256}; do
  timeout 90 ./build/bin/machmoe-bench --config $cfg --routing topk --iters 5 --warmup 2 --stage-runs 5 \
    --warmup-ms 300 --time-ms 300 --profile > /tmp/o.txt 2>&1
  echo "== $cfg rc=$? | $(grep -E '^  (forward|backward) ' /tmp/o.txt | tr -s ' ' | tr '\n' '|') $(grep -E 'they add up' /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-)"
  grep -E "back-to-back" /tmp/o.txt
done 2>&1 | tee "$OUT/profile.txt"
st done
