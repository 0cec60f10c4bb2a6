#!/usr/bin/env bash
# Session 57 call A: lineinfo build; ncu detail of token rounding's keys and select at E = 512; racecheck of the landed
# select; host timeline of the module against the C++ layer (T14).
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
st detail
KERNEL_REGEX='tr_select_bounded|tr_keys' BENCH_CONFIGS=16384:1536:256:512:8 LAUNCHES=4 DETAIL_TIMEOUT=150 \
  BENCH_ARGS="--routing token_rounding --warmup-ms 0 --time-ms 0 --stage-runs 1" \
  bash scripts/gpu_check.sh detail > "$OUT/detail.log" 2>&1
tail -n 40 "$OUT/detail.log"
st racecheck
timeout 200 compute-sanitizer --tool racecheck build-lineinfo/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter="*TokenRounding*E300*:*TokenRounding*E512*" > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $?"; grep -v "reference GEMM" "$OUT/racecheck.log" | tail -n 4
st host
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build-lineinfo/lib/libmachmoe_torch.so" PYTHONPATH="$PWD/python"
timeout 120 python3 .gl/host_trace.py 1.4B-256 7B-256 > "$OUT/host_trace.txt" 2>&1; echo "trace exit $?"
st overhead
timeout 150 python3 -m machmoe.benchmark.overhead --configs 1.4B-256,7B-256,30B-256 --modes isolated,queued --rounds 1 \
  --iters 20 --profile --json "$OUT/overhead.json" > "$OUT/overhead.txt" 2>&1; echo "overhead exit $?"
tail -n 30 "$OUT/overhead.txt"
st pack
cd "$OUT" && tar -czf /tmp/s57a.tgz --exclude='*.ncu-rep' . && mv /tmp/s57a.tgz "$OUT/" && ls -la "$OUT" | head; st done
