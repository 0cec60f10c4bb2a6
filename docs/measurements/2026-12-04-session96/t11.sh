#!/usr/bin/env bash
# Session 96, calls 2 and later (warm machine after call 1): T11, machmoe against upstream SonicMoE 0.1.2.post1 on
# the 12 main rows, both in turn per configuration (2 rounds), 300 ms windows, as sessions 69 and 90 ran it, through
# scripts/gpu_pybench.sh (installs the wheels carried into .peer_wheels/ once; --append continues the JSON in the next
# call; upstream's JIT caches stay in .peer_cache/ on the warm machine). The rows go in the order that decides T11
# first: 7B (256,128,8) and 120B (512,256,16), where session 90 missed, then 120B (1024,128,8), at 1.003x there.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
configs=7B-256,120B-512,120B-1024,7B-512,7B-1024,1.4B-256,120B-2048,1.4B-512,1.4B-1024,30B-256,30B-512,30B-1024
bash scripts/gpu_pybench.sh "${BUDGET:-570}" "$configs" .pybench/t11.json --impls machmoe --peers sonicmoe \
  --rounds 2 --warmup-ms 300 --time-ms 300 --no-plots --no-progress 2>&1 | tee "$OUT/t11_call${CALL:-2}.log" \
  | grep -v "^\s*$" | grep -v "^|" | tail -n 30
grep -E "^\| [0-9.]+B-[0-9]+ " .pybench/results.md 2>/dev/null | head -n 12
