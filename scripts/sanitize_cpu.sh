#!/usr/bin/env bash
# The CPU library and its GoogleTest suite built with AddressSanitizer and UndefinedBehaviorSanitizer (no CUDA, no
# torch), run once; any report fails. Host code (validation, memory layouts, the float64/float32 reference) is shared
# by every path, so undefined behaviour there is a bug everywhere. Used by CI; the GPU side has compute-sanitizer
# (scripts/gpu_check.sh sanitize).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MACHMOE_SANITIZE_BUILD_DIR:-$root/build-sanitize}"
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMACHMOE_ENABLE_CUDA=OFF \
  -DMACHMOE_BUILD_TORCH=OFF -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  >/dev/null
cmake --build "$build" --parallel "${MACHMOE_JOBS:-$(nproc)}" --target machmoe_cpu_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  "$build/tests/machmoe_cpu_tests" --gtest_brief=1
echo "sanitize_cpu: AddressSanitizer and UndefinedBehaviorSanitizer: no report"
