#!/usr/bin/env bash
# Session 104, call 3: call 1's expert-parallel step of 7B-256 again, four rounds, the three ways in reverse order
# every other round (call 1 always ran "now" last), to tell whether its 2-3 % slower step under master weights is
# the order or the backward's second cast. Build first (a fresh machine).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=docs/measurements/2026-12-06-session104
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call3.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call3.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
PYTHONPATH=$PWD/python MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 200 \
  python3 $here/ep_master_weights.py --configs 7B-256 --rounds 4 --alternate > "$OUT/ep_master_weights_call3.txt" 2>&1
echo "ep_master_weights exit $?"; grep -v Warning "$OUT/ep_master_weights_call3.txt" | tail -n 12
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
