#!/usr/bin/env bash
# The tests, from nothing: set up, build, run the CPU test suite (CTest label "cpu"). On a GPU machine pass
# --gpu to run every label (the GPU suites arrive with the GPU runtime and fail, not skip, without a GPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
labels=(-L cpu)
[ "${1:-}" = "--gpu" ] && labels=()
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
cd "${SONICMOE_BUILD_DIR:-$root/build}"
ctest --output-on-failure --parallel "$(nproc)" ${labels[@]+"${labels[@]}"}
