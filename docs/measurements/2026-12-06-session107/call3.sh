#!/usr/bin/env bash
# Session 107, call 3 (the code of call 2, on its machine, still warm: the build found nothing to do): T14 on the landed code, the `MoE` module against the C++
# layer on the 12 main rows (`python -m machmoe.benchmark.overhead --configs main --modes isolated`, both sides in
# one run); then every main row in the recompute mode (`--cache input_only`, top-K, 300 ms windows) for T7 against
# call 2's default-mode run.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call3.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > /tmp/build_call3.log 2>&1; st "build exit $?"
st overhead
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 280 \
  python3 -m machmoe.benchmark.overhead --configs main --modes isolated --json "$OUT/overhead_call3.json" \
  > "$OUT/overhead_call3.txt" 2>&1
echo "overhead exit $?"; tail -n 18 "$OUT/overhead_call3.txt"
st "all rows, input_only"
timeout 170 ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs --cache input_only \
  --json "$OUT/all_input_only_call3.json" > "$OUT/all_input_only_call3.txt" 2>&1
st "exit $?"
python3 scripts/bench_tables.py passes docs/measurements/2026-12-06-session107/all_preact_call2.json \
  "$OUT/all_input_only_call3.json" 2>&1 | tee "$OUT/t7_tables_call3.md"
st total
