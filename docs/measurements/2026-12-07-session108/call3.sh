#!/usr/bin/env bash
# Session 108, call 3 (prepared, not run): the landing call for topk_histograms.diff once applied: build; the whole
# gtest GPU suite's two shards beside pytest's GPU tests; compute-sanitizer (memcheck, racecheck) on the new test and
# the routing metadata tests; every main row with the default cache (the docs' tables after the GPU change).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
# The prepared change, unless the tree has it already (the device copy has no .git: patch, not git apply).
diff=docs/measurements/2026-12-07-session108/topk_histograms.diff
if patch -p1 -N -s --dry-run < "$diff" > /dev/null 2>&1; then patch -p1 -N -s < "$diff" && st "applied $diff"; fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu_call3.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > /tmp/build_call3.log 2>&1; st "build exit $?"
OUT=$OUT bash scripts/ab.sh pyg > /tmp/pyg_call3.txt 2>&1 &
pyg=$!
OUT=$OUT bash scripts/ab.sh gboth 2>&1 | tail -6
st "gtest shards done"
wait $pyg; st "pytest done"
tail -n 2 "$OUT/pytest_gpu.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -20
SF='GpuRoutingMetadataTopK.*:GpuRoutingMetadata/*' OUT=$OUT timeout 120 bash scripts/ab.sh san
st "sanitizers done"
timeout 120 ./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300 --all-configs --cache preact \
  --json "$OUT/all_preact_call3.json" > /tmp/all_call3.txt 2>&1
st "all rows exit $?"
{ python3 scripts/bench_tables.py passes "$OUT/all_preact_call3.json"; echo
  python3 scripts/bench_tables.py stages "$OUT/all_preact_call3.json"; } > "$OUT/tables_call3.md" 2>&1
(cd "$OUT" && tar -cJf logs_call3.tar.xz gtest_g0.log gtest_g1.log pytest_gpu.log $(ls sanitize_*.log 2>/dev/null) &&
  rm -f gtest_g0.log gtest_g1.log pytest_gpu.log sanitize_*.log)
st total
