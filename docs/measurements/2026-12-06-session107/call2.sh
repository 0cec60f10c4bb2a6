#!/usr/bin/env bash
# Session 107, call 2: after call 1, the layer's backward node rethrows an argument refusal as torch's ValueError
# (bindings/torch/layer_autograd.cpp; call 1's one failure was a refused backward arriving as RuntimeError). Build;
# every main row with the default cache (top-K, 300 ms windows), so that the docs' main table rests on the GPU code
# that lands (session 106's launch path with the SM margin, and this session's weight-gradient launch); then, after
# the benchmark so that they do not share the GPU with it, the whole gtest GPU suite's two shards and pytest's GPU
# tests in full, side by side (device_info.cu's two per-device caches are now one helper).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call2.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > /tmp/build_call2.log 2>&1; st "build exit $?"
grep -E "error" /tmp/build_call2.log | head -5
B="./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300"
timeout 200 $B --all-configs --cache preact --json "$OUT/all_preact_call2.json" > "$OUT/all_preact_call2.txt" 2>&1
st "all rows exit $?"
python3 scripts/bench_tables.py passes "$OUT/all_preact_call2.json" > "$OUT/tables_call2.md" 2>&1
echo >> "$OUT/tables_call2.md"; python3 scripts/bench_tables.py stages "$OUT/all_preact_call2.json" >> "$OUT/tables_call2.md" 2>&1
cat "$OUT/tables_call2.md" | head -16
OUT=$OUT bash scripts/ab.sh pyg > /tmp/pyg_call2.txt 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
st "gtest shards done"
wait $pyg; st "pytest done"
mv "$OUT/gtest_g0.log" "$OUT/gtest_g0_call2.log"; mv "$OUT/gtest_g1.log" "$OUT/gtest_g1_call2.log"
mv "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_call2.log"; tail -n 3 "$OUT/pytest_gpu_call2.log"
grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu_call2.log" | head -20
st total
