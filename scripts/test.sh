#!/usr/bin/env bash
# The tests, from nothing: set up, build, run the CPU test suites: CTest label "cpu" and the PyTorch tests not marked
# gpu. On a GPU machine pass --gpu to run every test that needs one GPU; on the 2-GPU machine --multigpu, on a 4-GPU
# one --gpus4, on an 8-GPU one --gpus8 to run everything the machine can (GPU tests fail, not skip, without their
# GPUs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
labels=(-L cpu)
case "${1:-}" in --gpu|--multigpu|--gpus4|--gpus8) labels=() ;; esac
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
build="${MACHMOE_BUILD_DIR:-$root/build}"
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
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-build-isolation "$root"
  markers=(-m "not gpu")
  [ "${1:-}" = "--gpu" ] && markers=(-m "not multigpu")  # one GPU
  [ "${1:-}" = "--multigpu" ] && markers=(-m "not gpus4 and not gpus8")  # the 2-GPU machine
  [ "${1:-}" = "--gpus4" ] && markers=(-m "not gpus8")                    # 4 GPUs
  [ "${1:-}" = "--gpus8" ] && markers=()                                  # 8 GPUs: everything
  (cd "$root/tests/python" && python3 -m pytest -q -p no:cacheprovider . ${markers[@]+"${markers[@]}"})
else
  echo "test: torch is not importable, so the PyTorch tests were not built or run (MACHMOE_NO_TORCH=1?)"
fi
