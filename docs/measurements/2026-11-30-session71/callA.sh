#!/usr/bin/env bash
# Session 71, call A: the weight gradients' wide tile with a 32 KiB staging buffer per consumer warpgroup and 3 ring
# stages (wgrad_staging.diff: four 64 x 64 blocks staged without waiting for a store) against main, and the same with
# no output stores at all (wgrad_no_store_on_staging.diff, on top of it: the epilogue's cost bound, not a result).
# From the repository root of a clean checkout of main: bash docs/measurements/2026-11-30-session71/callA.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
M=docs/measurements/2026-11-30-session71
t0=$(date +%s)
bash scripts/ab.sh build keep 2>&1 | tail -n 4                        # main -> /tmp/bench_main
AB_PATCH=$M/wgrad_staging.diff bash scripts/ab.sh apply 2>&1 | tail -n 2
GF='HopperWeightGrad*:ReferenceWeightGrad*' bash scripts/ab.sh gf 2>&1 | tee "$OUT/gf_staging.txt"
KEEP=staging bash scripts/ab.sh keep | tail -n 1
AB_PATCH=$M/wgrad_no_store_on_staging.diff bash scripts/ab.sh apply 2>&1 | tail -n 2
KEEP=nostore bash scripts/ab.sh keep | tail -n 1
echo "builds and tests: $(( $(date +%s) - t0 )) s"
run() {  # run <round> <config> <side>
  [ $(( $(date +%s) - t0 )) -gt 530 ] && { echo "== skipped $*: time"; return; }
  echo "== round $1 $2 $3"
  "/tmp/bench_$3" --config "$2" --warmup-ms 200 --time-ms 200 --stage-runs 1 2>/dev/null | tee -a "$OUT/bench_full.txt" |
    grep -E "^  (forward|backward) |backward/dw[12]"
}
{
  run 1 120B-2048 main; run 1 120B-2048 staging; run 1 120B-2048 nostore
  run 1 7B-256 main; run 1 7B-256 staging
  run 1 30B-256 main; run 1 30B-256 staging
  run 2 120B-2048 staging; run 2 120B-2048 main
  run 2 7B-256 staging; run 2 7B-256 main
} 2>&1 | tee "$OUT/bench.txt"
xz -f "$OUT/bench_full.txt" 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
