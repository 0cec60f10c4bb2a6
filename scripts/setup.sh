#!/usr/bin/env bash
# Installs what the build needs, from Debian and PyPI only, and nothing else. Idempotent: a second run changes
# nothing and needs no network.
#   Debian: cmake (>= 3.25), ninja, g++, GoogleTest.
#   PyPI:   nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe C++ headers) into third_party/cutlass (git-ignored);
#           torch==2.11.0, pytest, numpy for the PyTorch front end, matplotlib, rich, tqdm for python -m
#           machmoe.benchmark's plots and progress, torchtitan==0.2.2 (no dependencies but tyro and tokenizers) for
#           a test that compares with it (into the python3 found, unless already there).
# The CUDA toolkit (nvcc) is not installed here: the build compiles the CUDA sources for sm_90a when nvcc is present
# (/usr/local/cuda on the development, CI and GPU machines) and builds the CPU library alone otherwise.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=python_env.sh
. "$root/scripts/python_env.sh"
machmoe_use_venv "$root"  # a .venv made by an earlier run
cutlass_version=4.2.0.0
cutlass_dir="$root/third_party/cutlass"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# Ask Debian only for what is really missing, judged by the tools themselves (on the GPU machine, which has no
# network, cmake and GoogleTest come from its image rather than from Debian packages).
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }
missing=()
if ! command -v cmake >/dev/null 2>&1 || ! version_ge "$(cmake --version | head -n1 | awk '{print $3}')" 3.25; then
  missing+=(cmake)
fi
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
have_gtest=no
for f in /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
         /usr/local/lib/cmake/GTest/GTestConfig.cmake; do [ -f "$f" ] && have_gtest=yes; done
[ "$have_gtest" = yes ] || missing+=(libgtest-dev libgmock-dev)
have_cutlass() {
  [ -f "$cutlass_dir/.version" ] && [ "$(cat "$cutlass_dir/.version")" = "$cutlass_version" ] &&
    [ -f "$cutlass_dir/cutlass_library/source/include/cute/tensor.hpp" ]
}
if ! have_cutlass && ! python3 -m pip --version >/dev/null 2>&1; then missing+=(python3 python3-pip); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
cmake_now="$(cmake --version 2>/dev/null | head -n1 | awk '{print $3}')"
if ! version_ge "${cmake_now:-0}" 3.25; then
  # Debian 12 / Ubuntu 24.04 and later package cmake >= 3.25; older releases (Debian 11: 3.18, Ubuntu 22.04: 3.22)
  # do not, and CMakeLists.txt needs it.
  echo "setup: cmake >= 3.25 is needed, found ${cmake_now:-none} (Debian 12 / Ubuntu 24.04 or later package it; or" \
       "pip install 'cmake>=3.25' and put it first on PATH)" >&2
  exit 1
fi

if ! have_cutlass; then
  echo "setup: installing CUTLASS $cutlass_version headers (PyPI nvidia-cutlass) into third_party/cutlass"
  rm -rf "$cutlass_dir"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --root-user-action=ignore --target "$cutlass_dir" "nvidia-cutlass==$cutlass_version"
  echo "$cutlass_version" > "$cutlass_dir/.version"
fi
# The PyTorch front end: torch from PyPI (the CUDA 13.0 build; pip caches the wheels), pytest, numpy, and python -m
# machmoe.benchmark's optional extras: plots (matplotlib) and progress bars (rich, tqdm). Each group is installed only
# when one of its modules does not import (the GPU machine's image has them all, and no network); nothing with
# MACHMOE_NO_TORCH=1.
if [ "${MACHMOE_NO_TORCH:-0}" != 1 ]; then
  # "?" marks a group the tests compare against but nothing else needs: torchtitan 0.2.2's GroupedExperts (without its
  # training stack's dependencies; tyro and tokenizers are what its import needs). A machine without network (the
  # GPU machine) goes on without it, and that test fails there, saying why.
  python_groups=("torch:torch==2.11.0" "pytest,numpy,scikit_build_core:pytest numpy scikit-build-core"
                 "matplotlib,rich,tqdm:matplotlib rich tqdm" "?tyro,tokenizers:tyro tokenizers"
                 "?torchtitan:--no-deps torchtitan==0.2.2")
  to_install=()
  for group in "${python_groups[@]}"; do
    modules=${group%%:*}
    python3 -c "import ${modules#\?}" >/dev/null 2>&1 || to_install+=("$group")
  done
  if [ ${#to_install[@]} -gt 0 ] && machmoe_python_externally_managed; then
    # pip may not install into this python3 (PEP 668): a virtual environment of the checkout's own, which sees the
    # system's packages, and which build.sh and test.sh use from now on.
    echo "setup: $(command -v python3) is externally managed (PEP 668): making the virtual environment .venv/"
    if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
      sudo_if_needed apt-get update -qq
      DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends python3-venv
    fi
    python3 -m venv --system-site-packages "$root/.venv"
    machmoe_use_venv "$root"
  fi
  for group in ${to_install[@]+"${to_install[@]}"}; do
    read -r -a packages <<< "${group#*:}"
    [ "${group%%:*}" = torch ] && echo "setup: installing torch==2.11.0 from PyPI (large; cached by pip after the first time)"
    if [ "${group:0:1}" = "?" ]; then
      python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${packages[@]}" ||
        echo "setup: could not install ${group#*:} (no network?): tests/python/test_expert_parallel.py's comparison with torchtitan will fail"
    else
      python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${packages[@]}"
    fi
  done
fi
echo "setup: ok (cmake $(cmake --version | head -n1 | awk '{print $3}'), CUTLASS $cutlass_version, python3 $(command -v python3)," \
     "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo "not found: CPU-only build"))"
