#!/usr/bin/env bash
# Session 48's equivalence check: session 45's harness with tr_equivalence_changes.diff applied (both sides are given
# the bounds and row-scores regions, the new side also the saved per-token selection, which its backward reads; the
# expert-major keys are not compared, since the previous code overwrote its kept entries with grouped rows and the new
# one does not; the logits copy is not asked for, the repo's GPU tests compare it bitwise). Run from the repo root
# with the base source (main before the change) at /tmp/base and a build of the new code in build/. BASE_SEL=1 gives
# the base side the saved selection too (the second comparison: main fe7a3a9, which saves it, against 1966567).
set -e
H=/tmp/tr_equivalence_48; rm -rf "$H"; mkdir -p "$H/a"
cp docs/measurements/2026-11-27-h100-session45/tr_equivalence_main.cu docs/measurements/2026-11-27-h100-session45/tr_equivalence_wrap.cu "$H/a/"
(cd "$H/a" && patch -s -p1 < "$OLDPWD/docs/measurements/2026-11-27-h100-session48/tr_equivalence_changes.diff")
F="-std=c++17 -O3 -arch=sm_90a -Iinclude -Isrc -isystem third_party/cutlass/cutlass_library/source/include --expt-relaxed-constexpr"
nvcc $F -Dgpu=gpu_old -DTR_BOUNDS -DTR_ROWS ${BASE_SEL:+-DTR_SEL} -DTR_NAME=tr_old -DTR_SRC="\"${BASE_SRC:-/tmp/base}/src/gpu/token_rounding_kernels.cu\"" -c "$H/a/tr_equivalence_wrap.cu" -o /tmp/tr_old.o
nvcc $F -Dgpu=gpu_new -DTR_BOUNDS -DTR_ROWS -DTR_SEL -DTR_NAME=tr_new -DTR_SRC="\"$PWD/src/gpu/token_rounding_kernels.cu\"" -c "$H/a/tr_equivalence_wrap.cu" -o /tmp/tr_new.o
nvcc $F "$H/a/tr_equivalence_main.cu" /tmp/tr_old.o /tmp/tr_new.o -o /tmp/tr_equiv $(find ${LIBDIR:-build} -name libmachmoe.a | head -1)
[ -n "${NORUN:-}" ] || /tmp/tr_equiv
