#!/usr/bin/env bash
# Installs what the build needs, from Debian and PyPI only, and nothing else. Idempotent: a second run changes
# nothing and needs no network.
#   Debian: cmake (>= 3.25), ninja, g++, GoogleTest.
#   PyPI:   nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe C++ headers) into third_party/cutlass (git-ignored).
# The CUDA toolkit (nvcc) is not installed here: the build compiles the CUDA sources for sm_90a when nvcc is present
# (/usr/local/cuda on the development, CI and GPU machines) and builds the CPU library alone otherwise.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cutlass_version=4.2.0.0
cutlass_dir="$root/third_party/cutlass"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for pkg in cmake ninja-build g++ libgtest-dev libgmock-dev python3 python3-pip; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
# python3/pip may come from elsewhere (pyenv): only ask Debian for them when there is no working one.
if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
  missing=("${missing[@]/python3-pip/}")
  missing=("${missing[@]/python3/}")
fi
missing=(${missing[@]+"${missing[@]}"})
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ -f "$cutlass_dir/.version" ] && [ "$(cat "$cutlass_dir/.version")" = "$cutlass_version" ] &&
   [ -f "$cutlass_dir/cutlass_library/source/include/cute/tensor.hpp" ]; then
  :
else
  echo "setup: installing CUTLASS $cutlass_version headers (PyPI nvidia-cutlass) into third_party/cutlass"
  rm -rf "$cutlass_dir"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --root-user-action=ignore --target "$cutlass_dir" "nvidia-cutlass==$cutlass_version"
  echo "$cutlass_version" > "$cutlass_dir/.version"
fi
echo "setup: ok (cmake $(cmake --version | head -n1 | awk '{print $3}'), CUTLASS $cutlass_version," \
     "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo "not found: CPU-only build"))"
