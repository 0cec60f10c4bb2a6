#!/usr/bin/env bash
# Session 68, call 7 (fresh lease, the session's last ~5 minutes of device time): T14's module-against-C++ figures on
# the landed code (8ade8d3), isolated mode only (T14's figure), the 12 main configurations, as far as time allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build | grep -E "exit|error" | head -5
st overhead
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 170 \
  python3 -m machmoe.benchmark.overhead --configs main --modes isolated --json "$OUT/overhead.json" \
  > "$OUT/overhead.txt" 2>&1
echo "overhead exit $?"; tail -n 25 "$OUT/overhead.txt"
st done
