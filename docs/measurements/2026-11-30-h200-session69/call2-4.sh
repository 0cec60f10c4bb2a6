#!/usr/bin/env bash
# Session 69, calls 2 and 3 (warm machine after call 1): T11, machmoe against upstream SonicMoE 0.1.2.post1 on the
# 12 main rows, both in turn per configuration (2 rounds), 300 ms windows, through scripts/gpu_pybench.sh (installs
# the wheels carried into .peer_wheels/ once; --append continues the JSON in the next call).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu_pybench.sh "${BUDGET:-540}" main .pybench/t11.json --impls machmoe --peers sonicmoe --rounds 2 \
  --warmup-ms 300 --time-ms 300 --no-plots --no-progress 2>&1 | tee "$OUT/t11_${CALL:-2}.log" | grep -v "^\s*$" | tail -n 40
