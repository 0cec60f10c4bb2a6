#!/usr/bin/env bash
# Session 66, call B (fresh lease): the gather-sum with a batch of 4 pairs' rows copied into shared memory (cp.async)
# and router_term_from_pairs from MoEProblem::logit_grad_at_selections(): full build (with the PyTorch operators), the
# whole gtest GPU binary in two shards, pytest's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh build gboth pyg
for f in gtest_g0.log gtest_g1.log; do grep -v "reference GEMM" "$OUT/$f" | tail -n 40 > "$OUT/${f%.log}_tail.txt"; done
tail -n 30 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
bash scripts/ab.sh pack
