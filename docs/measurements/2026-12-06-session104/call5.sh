#!/usr/bin/env bash
# Session 104, call 5 (after the review's mend of the backward's fallback checks and of ExpertParallelMoE's early
# expert check): build; the whole gtest GPU suite (two shards) and pytest's GPU tests in full, all three side by side
# (the session's device time allows no more).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call5.txt"
start=$(date +%s)
MACHMOE_JOBS=16 bash scripts/build.sh > "$OUT/build_call5.log" 2>&1; echo "build exit $? in $(( $(date +%s) - start )) s"
OUT=$OUT bash scripts/ab.sh pyg > "$OUT/pyg_call5.txt" 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
wait $pyg; tail -n 3 "$OUT/pyg_call5.txt"
mv "$OUT/gtest_g0.log" "$OUT/gtest_g0_call5.log"; mv "$OUT/gtest_g1.log" "$OUT/gtest_g1_call5.log"
mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call5.log"; grep -E "^FAILED|Error" "$OUT/pytest_gpu_call5.log" | head -20
echo "total $(( $(date +%s) - start )) s"
rm -f "$OUT"/build*.log
