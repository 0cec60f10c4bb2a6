#!/usr/bin/env bash
# builds and runs the one-off equivalence check; run from the repo root with the base source at /tmp/base
set -e
F="-std=c++17 -O3 -arch=sm_90a -Iinclude -Isrc -isystem third_party/cutlass/cutlass_library/source/include --expt-relaxed-constexpr"
nvcc $F -Dgpu=gpu_old -DTR_BOUNDS -DTR_NAME=tr_old -DTR_SRC="\"${BASE_SRC:-/tmp/base}/src/gpu/token_rounding_kernels.cu\"" -c docs/measurements/2026-11-27-h100-session47/tr_equivalence/wrap.cu -o /tmp/tr_old.o &
nvcc $F -Dgpu=gpu_new -DTR_BOUNDS -DTR_ROWS -DTR_NAME=tr_new -DTR_SRC="\"$PWD/src/gpu/token_rounding_kernels.cu\"" -c docs/measurements/2026-11-27-h100-session47/tr_equivalence/wrap.cu -o /tmp/tr_new.o &
wait
nvcc $F docs/measurements/2026-11-27-h100-session47/tr_equivalence/main.cu /tmp/tr_old.o /tmp/tr_new.o -o /tmp/tr_equiv $(find ${LIBDIR:-build} -name libmachmoe.a | head -1)
[ -n "${NORUN:-}" ] || /tmp/tr_equiv
