#!/usr/bin/env bash
# Session 65, call C (the warm machine of call B): pytest's GPU tests, and compute-sanitizer memcheck and racecheck on
# the dH kernel's tests, side by side.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -x build/tests/machmoe_gpu_tests ] || { st "no build: building"; bash scripts/ab.sh build | tail -n 1; }
st "pytest and sanitizers"
bash scripts/ab.sh pyg > /tmp/pyg.txt 2>&1 &
P=$!
SF='HopperDhKernelProperties.*' bash scripts/ab.sh san
wait $P; cat /tmp/pyg.txt
st done
