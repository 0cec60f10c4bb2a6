#!/usr/bin/env bash
# Upstream SonicMoE (and what it needs) for `python -m machmoe.benchmark` on a GPU machine without network.
#
#   bash scripts/peer_wheels.sh fetch     # here (PyPI reachable): wheels for the GPU machine's Python into .peer_wheels/
#   bash scripts/peer_wheels.sh install   # there: unpack them into .peer_site/ (pip --target; nothing else touched)
#   eval "$(bash scripts/peer_wheels.sh env)"   # there: PYTHONPATH for the benchmark to import sonicmoe
#
# Versions known to work with torch 2.11: sonic-moe 0.1.2.post1, nvidia-cutlass-dsl 4.4.2, quack-kernels 0.3.11.
# nvidia-cutlass-dsl-libs-base's wheel (74 MB) is larger than one transfer to the GPU machine may carry (64 MiB with
# everything else), so it travels unpacked and recompressed as .tar.xz (54 MB), in a call of its own (the build
# outputs stay on the warm machine between calls). Installed with --target, the package's .pth file is not read, so
# `env` adds nvidia_cutlass_dsl/python_packages to PYTHONPATH itself.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$root/.peer_wheels"
site="$root/.peer_site"
python_version="${MACHMOE_PEER_PYTHON:-3.12}"  # the GPU machine's Python (torch 2.11 there)

case "${1:-}" in
  fetch)
    mkdir -p "$wheels"
    python3 -m pip download --no-deps --quiet --disable-pip-version-check --python-version "$python_version" \
      --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$wheels" \
      "sonic-moe==0.1.2.post1" "quack-kernels==0.3.11" "nvidia-cutlass-dsl==4.4.2" \
      "nvidia-cutlass-dsl-libs-base==4.4.2" apache-tvm-ffi torch-c-dlpack-ext
    big=$(ls "$wheels"/nvidia_cutlass_dsl_libs_base-*.whl)
    tmp="$(mktemp -d)"
    python3 -m zipfile -e "$big" "$tmp"
    tar -C "$tmp" -cf - . | xz -T0 -6 > "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"
    rm -rf "$tmp" "$big"
    ls -l "$wheels"
    echo "peer_wheels: carry .peer_wheels/nvidia_cutlass_dsl_libs_base.tar.xz in one call and the other wheels in" \
         "another (or together, without third_party)"
    ;;
  install)
    mkdir -p "$site"
    if [ -f "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz" ]; then
      tar -C "$site" -xJf "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"
    fi
    shopt -s nullglob
    whls=("$wheels"/*.whl)
    if [ ${#whls[@]} -gt 0 ]; then
      python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-index \
        --upgrade --target "$site" "${whls[@]}"
    fi
    echo "peer_wheels: installed into $site; now: eval \"\$(bash scripts/peer_wheels.sh env)\""
    ;;
  env)
    echo "export PYTHONPATH=\"$site:$site/nvidia_cutlass_dsl/python_packages\${PYTHONPATH:+:\$PYTHONPATH}\""
    ;;
  *)
    echo "usage: bash scripts/peer_wheels.sh fetch|install|env" >&2
    exit 2
    ;;
esac
