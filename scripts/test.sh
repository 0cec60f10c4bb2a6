#!/usr/bin/env bash
# The tests, from nothing: set up, build, run the CPU test suites: CTest label "cpu" and the PyTorch tests not marked
# gpu. On a GPU machine pass --gpu to run every test that needs one GPU; on the 2-GPU machine --multigpu, on a 4-GPU
# one --gpus4, on an 8-GPU one --gpus8 to run everything the machine can (GPU tests fail, not skip, without their
# GPUs). It fails when a part it should run is missing: the PyTorch operators (unless MACHMOE_NO_TORCH=1 on a CPU
# run), or with --gpu* the GPU test binary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
labels=(-L cpu)
gpu_run=no
if [ $# -gt 1 ]; then  # one option at most: the others would be ignored
  echo "test: one option at most, got $# ('$*') (expected none, --gpu, --multigpu, --gpus4 or --gpus8)" >&2; exit 2
fi
case "${1:-}" in
  "") ;;
  --gpu|--multigpu|--gpus4|--gpus8) labels=() gpu_run=yes ;;
  *) echo "test: unknown option '$1' (expected none, --gpu, --multigpu, --gpus4 or --gpus8)" >&2; exit 2 ;;
esac
bash "$root/scripts/setup.sh"
# shellcheck source=python_env.sh
. "$root/scripts/python_env.sh"
machmoe_use_venv "$root"  # the python3 setup.sh installed into
bash "$root/scripts/build.sh"
build="${MACHMOE_BUILD_DIR:-$root/build}"
# A GPU run without the GPU tests would pass on the CPU tests alone: the CUDA sources are built only where nvcc is.
if [ "$gpu_run" = yes ] && [ ! -x "$build/tests/machmoe_gpu_tests" ]; then
  echo "test: $1 asks for the GPU tests, but the build has none (no nvcc found: the CUDA sources were not built)" >&2
  exit 1
fi
if ! (cd "$build" && ctest --output-on-failure --parallel "$(nproc)" ${labels[@]+"${labels[@]}"}); then
  # CTest lists each gtest binary's tests when it starts; when that fails, its message (the whole list) fills the
  # end of the log. Say here, last, how the listing went: exit status and time.
  for bin in "$build"/tests/machmoe_cpu_tests "$build"/tests/machmoe_gpu_tests; do
    [ -x "$bin" ] || continue
    start=$(date +%s%N); status=0
    "$bin" --gtest_list_tests >/dev/null 2>&1 || status=$?
    echo "test: $(basename "$bin") --gtest_list_tests: exit status $status after $(( ($(date +%s%N) - start) / 1000000 )) ms"
  done
  echo "test: ctest failed (see above)" >&2
  exit 1
fi
# The PyTorch front end (pytest): the CPU part everywhere, the GPU part (marker gpu) with --gpu.
if [ -f "$build/lib/libmachmoe_torch.so" ]; then
  echo "test: installing the machmoe package (pip install --no-build-isolation .)"
  # Into the build above (scikit-build-core's build-dir, the tests and benchmarks kept in its configuration), so that
  # pip only installs what is built: its own build directory compiled every CUDA source a second time (7 minutes of
  # a 23-minute CI run on 2 cores).
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-build-isolation \
    -C build-dir="$(cd "$build" && pwd)" -C cmake.define.MACHMOE_BUILD_TESTS=ON -C cmake.define.MACHMOE_BUILD_BENCHMARKS=ON "$root"
  markers=(-m "not gpu")
  [ "${1:-}" = "--gpu" ] && markers=(-m "not multigpu")  # one GPU
  [ "${1:-}" = "--multigpu" ] && markers=(-m "not gpus4 and not gpus8")  # the 2-GPU machine
  [ "${1:-}" = "--gpus4" ] && markers=(-m "not gpus8")                    # 4 GPUs
  [ "${1:-}" = "--gpus8" ] && markers=()                                  # 8 GPUs: everything
  (cd "$root/tests/python" && python3 -m pytest -q -p no:cacheprovider . ${markers[@]+"${markers[@]}"})
elif [ "${MACHMOE_NO_TORCH:-0}" = 1 ] && [ "$gpu_run" = no ]; then
  echo "test: MACHMOE_NO_TORCH=1: the PyTorch front end was not built, and its tests did not run"
else
  # Setup installs torch, so a missing operator library is a failure, not a reason to pass on fewer tests.
  echo "test: the PyTorch operator library was not built ($build/lib/libmachmoe_torch.so is missing: python3 cannot" \
       "import torch?), so the PyTorch tests cannot run" >&2
  exit 1
fi
