#!/usr/bin/env bash
# Session 68, call 6 (warm, after call5.sh): pytest's GPU tests on call 5's build.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh pyg
tail -n 30 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
grep -E "compiled_autograd" "$OUT/pytest_gpu.log" | head
bash scripts/ab.sh pack > /dev/null
