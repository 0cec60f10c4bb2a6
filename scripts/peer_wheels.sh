#!/usr/bin/env bash
# Upstream SonicMoE (and what it needs) for `python -m machmoe.benchmark` on a GPU machine without network.
#
#   bash scripts/peer_wheels.sh fetch     # here (PyPI reachable): wheels for the GPU machine's Python into .peer_wheels/
#   bash scripts/peer_wheels.sh install   # there: unpack them into .peer_site/ (pip --target; nothing else touched)
#   eval "$(bash scripts/peer_wheels.sh env)"   # there: PYTHONPATH for the benchmark to import sonicmoe
#
# Versions known to work with torch 2.11: sonic-moe 0.1.2.post1, nvidia-cutlass-dsl 4.4.2, quack-kernels 0.3.11.
# nvidia-cutlass-dsl-libs-base's wheel (74 MB) is larger than one transfer to the GPU machine may carry (64 MiB with
# the working tree and everything else), so it is unpacked, recompressed as .tar.xz (54 MB) and split in two parts
# (.tar.xz.part-aa, -ab), each carried in a call of its own (ignored outputs stay on the warm machine between calls);
# `install` joins them. In session 69 the whole .tar.xz and the 12 MB working tree were refused together. The first
# part is 18 MB so that it fits beside the build's needs in the first call (session 90): CUTLASS's two include folders
# (third_party/cutlass/cutlass_library/source/include and .../source/tools/util/include, 27 MB), the small wheels
# (4.5 MB) and the 15 MB working tree; the second part (36 MB) goes alone with the next call. Since session 96 the
# include folders travel as .peer_wheels/cutlass_headers.tar.xz (1 MB), which scripts/gpu_pybench.sh unpacks.
# Installed with --target, the package's .pth file is not read, so `env` adds nvidia_cutlass_dsl/python_packages to
# PYTHONPATH itself.
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
    (cd "$wheels" && rm -f nvidia_cutlass_dsl_libs_base.tar.xz.part-* &&
      head -c 18000000 nvidia_cutlass_dsl_libs_base.tar.xz > nvidia_cutlass_dsl_libs_base.tar.xz.part-aa &&
      tail -c +18000001 nvidia_cutlass_dsl_libs_base.tar.xz > nvidia_cutlass_dsl_libs_base.tar.xz.part-ab &&
      rm nvidia_cutlass_dsl_libs_base.tar.xz)
    # CUTLASS's two include folders (28 MB, from scripts/setup.sh) as a 1-MB .tar.xz, which scripts/gpu_pybench.sh
    # unpacks on a GPU machine that lacks them: the build's headers then take a megabyte of the first call's carry.
    cutlass_src="third_party/cutlass/cutlass_library/source"
    if [ -d "$root/$cutlass_src/include" ]; then
      tar -C "$root" -cf - "$cutlass_src/include" "$cutlass_src/tools/util/include" | xz -T0 -9 \
        > "$wheels/cutlass_headers.tar.xz"
    else
      echo "peer_wheels: no $cutlass_src/include here (run scripts/setup.sh first), so no cutlass_headers.tar.xz" >&2
    fi
    ls -l "$wheels"
    echo "peer_wheels: carry part-aa with the small wheels and cutlass_headers.tar.xz in one call, part-ab alone in" \
         "the next (ignored paths, one carry entry each)"
    ;;
  install)
    mkdir -p "$site"
    shopt -s nullglob
    parts=("$wheels"/nvidia_cutlass_dsl_libs_base.tar.xz.part-*)
    if [ ${#parts[@]} -gt 0 ]; then
      cat "${parts[@]}" > "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"
      if ! xz -t "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"; then
        echo "peer_wheels: the joined parts are not a whole .tar.xz (a part missing?): ${parts[*]}" >&2
        rm -f "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"
        exit 1
      fi
    fi
    if [ -f "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz" ]; then
      tar -C "$site" -xJf "$wheels/nvidia_cutlass_dsl_libs_base.tar.xz"
    fi
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
