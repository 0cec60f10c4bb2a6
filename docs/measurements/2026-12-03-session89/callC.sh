#!/usr/bin/env bash
# Session 89, call C (fresh machine): the benchmark as committed (fa3d970: the diagnostic of call B without its
# busy-kernel timing; every timing through one call timer): build, then `--profile` on 1.4B-256 and a plain run of
# 7B-256, both top-K, 300 ms windows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git log --oneline -1 | cut -c1-60  # (the device copy's git history, not the checkout's: it printed 2d3ab44)
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st run
./build/bin/machmoe-bench --config 1.4B-256 --routing topk --warmup-ms 300 --time-ms 300 --profile > "$OUT/callC_profile_1.4B-256.txt" 2>&1
echo "profile exit $?"
./build/bin/machmoe-bench --config 7B-256 --routing topk --warmup-ms 300 --time-ms 300 > "$OUT/callC_7B-256.txt" 2>&1
echo "plain exit $?"
grep -E "^  (forward|backward) |add up|back-to-back|called alone|busy" "$OUT"/callC_*.txt
st done
