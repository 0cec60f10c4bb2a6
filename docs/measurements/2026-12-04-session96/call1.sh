#!/usr/bin/env bash
# Session 96, call 1 (fresh machine): unpack CUTLASS's two include folders from the 1-MB .tar.xz carried in
# .peer_wheels/cutlass_headers.tar.xz (the folders themselves are 28 MB of the 64-MiB carry limit), then build the
# checkout for scripts/gpu_pybench.sh (which then skips its own build). The call also carries upstream SonicMoE's five
# small wheels and the first 18 MB part of nvidia_cutlass_dsl_libs_base.tar.xz (scripts/peer_wheels.sh fetch); the
# second part goes with call 2 (t11.sh).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
[ -d third_party/cutlass/cutlass_library/source/include ] || tar -xJf .peer_wheels/cutlass_headers.tar.xz
mkdir -p build
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > build/call1_build.log 2>&1; rc=$?
tail -n 3 build/call1_build.log; echo "build rc $rc after $(( $(date +%s) - S )) s"
ls -l build/lib/libmachmoe_torch.so .peer_wheels | tail -n 9
