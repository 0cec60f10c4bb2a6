#!/usr/bin/env bash
# Session 72, call C (one H200): where the weight gradients and the small rows' dH kernel lose to cuBLAS, by ncu
# (--set full, one launch each at the unlocked clock): machmoe's dW2 and dW1 on 120B (2048,64,4) and its dH kernel on
# 7B (256,128,8), against the strided-batched cuBLAS GEMM that the benchmark's bound times for each
# (bound_gemm_probe.cu, called as benchmarks/gpu_bench.cu calls it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
t0=$(date +%s)
M=docs/measurements/2026-11-30-session72
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build --target machmoe-bench --parallel "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build exit $? ($(( $(date +%s) - t0 )) s)"
nvcc -O2 -arch=sm_90a $M/bound_gemm_probe.cu -lcublas -o /tmp/probe >> "$OUT/build.log" 2>&1; echo "probe build exit $?"
BENCH="--iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1"
prof() {  # prof <name> <ncu args...> -- <command...>
  local name=$1; shift
  timeout 120 ncu --clock-control none --set full --import-source no "$@" > "$OUT/ncu_$name.txt" 2>&1
  echo "ncu $name exit $? ($(( $(date +%s) - t0 )) s): $(grep -cE '^  [a-zA-Z_].*\(' "$OUT/ncu_$name.txt") kernels"
}
prof wgrad_120b --kernel-name-base demangled -k "regex:MainloopVarlenK" --launch-count 2 \
  ./build/bin/machmoe-bench --config 120B-2048 $BENCH
prof cublas_dw2_120b --launch-skip 5 --launch-count 1 /tmp/probe 64 4096 2048 2048
prof cublas_dw1_120b --launch-skip 5 --launch-count 1 /tmp/probe 64 4096 4096 2048
prof dh_7b --kernel-name-base demangled -k "regex:EpilogueActivationGrad" --launch-count 1 \
  ./build/bin/machmoe-bench --config 7B-256 $BENCH
prof cublas_dh_7b --launch-skip 5 --launch-count 1 /tmp/probe 128 1536 256 1536
for f in "$OUT"/ncu_*.txt; do xz -f "$f"; done
echo "total: $(( $(date +%s) - t0 )) s"
