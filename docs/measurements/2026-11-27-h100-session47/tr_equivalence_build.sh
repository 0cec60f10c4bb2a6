#!/usr/bin/env bash
# Session 47's equivalence check: session 45's harness with tr_equivalence_changes.diff applied (both sides are given
# the bounds region, the new side also the row-scores region; the token-major keys are compared only where E > 512).
# Run from the repo root with the base source (main before the change) at /tmp/base and a build of the new code in
# build/.
set -e
H=/tmp/tr_equivalence_47; rm -rf "$H"; mkdir -p "$H/a"
cp docs/measurements/2026-11-27-h100-session45/tr_equivalence_main.cu docs/measurements/2026-11-27-h100-session45/tr_equivalence_wrap.cu "$H/a/"
(cd "$H/a" && patch -s -p1 < "$OLDPWD/docs/measurements/2026-11-27-h100-session47/tr_equivalence_changes.diff")
F="-std=c++17 -O3 -arch=sm_90a -Iinclude -Isrc -isystem third_party/cutlass/cutlass_library/source/include --expt-relaxed-constexpr"
nvcc $F -Dgpu=gpu_old -DTR_BOUNDS -DTR_NAME=tr_old -DTR_SRC="\"${BASE_SRC:-/tmp/base}/src/gpu/token_rounding_kernels.cu\"" -c "$H/a/tr_equivalence_wrap.cu" -o /tmp/tr_old.o
nvcc $F -Dgpu=gpu_new -DTR_BOUNDS -DTR_ROWS -DTR_NAME=tr_new -DTR_SRC="\"$PWD/src/gpu/token_rounding_kernels.cu\"" -c "$H/a/tr_equivalence_wrap.cu" -o /tmp/tr_new.o
nvcc $F "$H/a/tr_equivalence_main.cu" /tmp/tr_old.o /tmp/tr_new.o -o /tmp/tr_equiv $(find ${LIBDIR:-build} -name libmachmoe.a | head -1)
[ -n "${NORUN:-}" ] || /tmp/tr_equiv
