#!/usr/bin/env bash
# Session 90, call 1 (fresh machine): build (scripts/ab.sh build), then the committed benchmark's --profile on
# 1.4B-256 (top-K, 300 ms windows): the first GPU run of 2391a5e's host code. The call also carries CUTLASS's two
# include folders, upstream SonicMoE's small wheels and the first 18 MB part of nvidia-cutlass-dsl-libs-base
# (scripts/peer_wheels.sh fetch, re-split so that CUTLASS, the wheels, one part and the working tree fit the 64 MiB a
# call may carry); the second part goes with call 2 (t11.sh).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
ls -l build/lib/libmachmoe_torch.so .peer_wheels | tail -n 8
st profile
./build/bin/machmoe-bench --config 1.4B-256 --routing topk --warmup-ms 300 --time-ms 300 --profile > "$OUT/call1_profile_1.4B-256.txt" 2>&1
echo "profile exit $?"
grep -E "^  (forward|backward) |add up|back-to-back|called alone" "$OUT/call1_profile_1.4B-256.txt"
st done
