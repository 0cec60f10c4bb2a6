#!/usr/bin/env bash
# The tests, from nothing: set up, build, run the CPU test suites: CTest label "cpu" and the PyTorch tests not marked
# gpu. On a GPU machine pass --gpu to run every test that needs one GPU, on the 2-GPU machine --multigpu to run
# everything (GPU tests fail, not skip, without their GPUs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
labels=(-L cpu)
[ "${1:-}" = "--gpu" ] || [ "${1:-}" = "--multigpu" ] && labels=()
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
build="${MACHMOE_BUILD_DIR:-$root/build}"
(cd "$build" && ctest --output-on-failure --parallel "$(nproc)" ${labels[@]+"${labels[@]}"})
# The PyTorch front end (pytest): the CPU part everywhere, the GPU part (marker gpu) with --gpu.
if [ -f "$build/lib/libmachmoe_torch.so" ]; then
  echo "test: installing the machmoe package (pip install --no-build-isolation .)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-build-isolation "$root"
  markers=(-m "not gpu")
  [ "${1:-}" = "--gpu" ] && markers=(-m "not multigpu")  # one GPU
  [ "${1:-}" = "--multigpu" ] && markers=()                  # the 2-GPU machine: everything
  (cd "$root/tests/python" && python3 -m pytest -q -p no:cacheprovider . ${markers[@]+"${markers[@]}"})
else
  echo "test: torch is not importable, so the PyTorch tests were not built or run (MACHMOE_NO_TORCH=1?)"
fi
