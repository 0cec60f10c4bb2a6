#!/usr/bin/env bash
# Configures and builds into build/ (Release: -DNDEBUG, which the CUTLASS kernels need). Used by main.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SONICMOE_BUILD_DIR:-$root/build}"
jobs="${SONICMOE_JOBS:-$(nproc)}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --parallel "$jobs"
