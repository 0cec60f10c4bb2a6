#!/usr/bin/env bash
# The one-off check of session 44: main 110d1ca's top-K kernel and the new one compiled side by side (namespaces
# renamed by the preprocessor), run on the same logits, every score and index compared bitwise.
# Run from the repository root after bash scripts/build.sh, on a GPU machine.
set -e
git show 110d1ca:src/gpu/router_kernels.cu > /tmp/old_router_kernels.cu
F="-std=c++17 -O3 -arch=sm_90a -Iinclude -Isrc --expt-relaxed-constexpr"
nvcc $F -Dgpu=gpu_old -c /tmp/old_router_kernels.cu -o /tmp/old_rk.o
nvcc $F -Dgpu=gpu_new -c src/gpu/router_kernels.cu -o /tmp/new_rk.o
nvcc $F docs/measurements/2026-11-27-h100-session44/topk_equivalence.cu /tmp/old_rk.o /tmp/new_rk.o -o /tmp/topk_equiv \
  "$(find build -name libmachmoe.a | head -1)" -lcublas
/tmp/topk_equiv
