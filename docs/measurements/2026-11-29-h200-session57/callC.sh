#!/usr/bin/env bash
# Session 57 call C: T14's isolated forward, the overhead tool's way and other ways, same process and code (main).
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st build
bash scripts/setup.sh > "$OUT/setup.log" 2>&1
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build.log"
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" PYTHONPATH="$PWD/python"
st layers2
timeout 200 python3 .gl/layers2.py 30 1.4B-256 7B-256 > "$OUT/layers2.txt" 2>&1; echo "exit $?"; cat "$OUT/layers2.txt"
st tool
timeout 150 python3 -m machmoe.benchmark.overhead --configs 1.4B-256,7B-256 --modes isolated --rounds 1 --iters 30 \
  --json "$OUT/overhead_c.json" > "$OUT/overhead_c.txt" 2>&1; echo "exit $?"; grep -E "^\| " "$OUT/overhead_c.txt"
st done
