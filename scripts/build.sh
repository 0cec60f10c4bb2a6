#!/usr/bin/env bash
# Configures and builds into build/ (Release: -DNDEBUG, which the CUTLASS kernels need). Used by main.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=python_env.sh
. "$root/scripts/python_env.sh"
machmoe_use_venv "$root"  # the python3 setup.sh installed into
build="${MACHMOE_BUILD_DIR:-$root/build}"
jobs="${MACHMOE_JOBS:-$(nproc)}"
# The PyTorch operator library is built whenever the python3 found can import torch.
torch_opt=OFF
if [ "${MACHMOE_NO_TORCH:-0}" != 1 ] && python3 -c "import torch" >/dev/null 2>&1; then torch_opt=ON; fi
# MACHMOE_CMAKE_ARGS: extra configure arguments, e.g. "-DCMAKE_CUDA_FLAGS=-lineinfo" for ncu's source view.
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH="$torch_opt" ${MACHMOE_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" --parallel "$jobs"
