#!/usr/bin/env bash
# Session 91, call 6 (call 5's machine, warm, its build): pytest's one-GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
[ -f build/lib/libmachmoe_torch.so ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
st pyg; bash scripts/ab.sh pyg 2>&1 | grep -vE "^\[[0-9]+s\]"
tail -n 1 "$OUT/pytest_gpu.log" > "$OUT/call6_pytest_summary.txt"
grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -10; rm -f "$OUT/pytest_gpu.log" "$OUT/build.log"
st done
